"""Webhooks: a job's or a batch's deliveries and their attempts, a redelivery, the signing secrets.

Deliveries are recorded by the store with their event and delivered by the hook workers
(``spool worker --kind hooks``); docs/webhooks.md.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict

from api.auth import current_owner
from api.deps import JobId, ServicesDep, owned_batch
from api.errors import ApiError
from api.services import Services
from common.store import JobNotFound
from common.store.hooks import AsyncHookStore
from common.webhooks import (
    DEFAULT_EVENTS,
    MAX_ENDPOINTS,
    BadDestination,
    check_destination,
    check_events,
    owner_secrets,
)

router = APIRouter(tags=["webhooks"])

BatchId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
DeliveryId = Annotated[str, Path(pattern=r"^whd_[0-9]{1,9}$")]


def _hooks(services: Services) -> AsyncHookStore:
    return AsyncHookStore(services.store.redis, services.settings)


async def _owned_job(services: Services, job_id: str) -> None:
    owner = await services.store.owner(job_id)
    if owner is None or owner != current_owner():
        raise JobNotFound(job_id)


async def _retry(services: Services, kind: str, object_id: str, delivery_id: str) -> dict[str, Any]:
    n = int(delivery_id.removeprefix("whd_"))
    delivery = await _hooks(services).retry(kind, object_id, n, current_owner())
    if delivery is None:
        raise ApiError(
            404,
            f"No webhook delivery {delivery_id!r} of {object_id!r}",
            param="delivery_id",
            code="not_found",
        )
    return delivery


def _page(deliveries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": deliveries}


@router.get("/v1/jobs/{job_id}/webhooks")
async def job_webhooks(job_id: JobId, services: ServicesDep) -> dict[str, Any]:
    """The job's webhook deliveries, oldest first, each with its attempts (time, status code or
    error) and its next attempt's time while it is retried."""
    await _owned_job(services, job_id)
    return _page(await _hooks(services).deliveries("job", job_id))


@router.post("/v1/jobs/{job_id}/webhooks/{delivery_id}/retry")
async def retry_job_webhook(job_id: JobId, delivery_id: DeliveryId, services: ServicesDep) -> dict[str, Any]:
    """Deliver it again (the same event id and body), after the job's other deliveries; a URL
    that a 410 disabled is enabled again."""
    await _owned_job(services, job_id)
    return await _retry(services, "job", job_id, delivery_id)


@router.get("/v1/batches/{batch_id}/webhooks")
async def batch_webhooks(batch_id: BatchId, services: ServicesDep) -> dict[str, Any]:
    await owned_batch(services.batches, batch_id)
    return _page(await _hooks(services).deliveries("batch", batch_id))


@router.post("/v1/batches/{batch_id}/webhooks/{delivery_id}/retry")
async def retry_batch_webhook(
    batch_id: BatchId, delivery_id: DeliveryId, services: ServicesDep
) -> dict[str, Any]:
    await owned_batch(services.batches, batch_id)
    return await _retry(services, "batch", batch_id, delivery_id)


class EndpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    events: list[str] | None = None  # of start, part, completed; default completed


EndpointId = Annotated[str, Path(pattern=r"^whe_[0-9a-f]{1,64}$")]


@router.post("/v1/webhook_endpoints")
async def create_endpoint(body: EndpointRequest, services: ServicesDep) -> dict[str, Any]:
    """A server-wide endpoint of this API key: it receives the events of every job the key
    submits from now on (besides each job's own ``webhook``)."""
    settings = services.settings
    try:
        events = check_events(body.events if body.events is not None else DEFAULT_EVENTS)
        if not events:
            raise ValueError("events names at least one of start, part, completed")
    except ValueError as e:
        raise ApiError(400, str(e), param="events", code="invalid_webhook") from None
    try:
        await check_destination(body.url, settings.webhook_allow_private, settings.webhook_allow_host_set)
    except BadDestination as e:
        raise ApiError(400, str(e), param="url", code="invalid_webhook") from None
    endpoint = await _hooks(services).add_endpoint(current_owner(), body.url, events)
    if endpoint is None:
        raise ApiError(
            400,
            f"an API key has at most {MAX_ENDPOINTS} webhook endpoints",
            param="url",
            code="too_many_endpoints",
        )
    return endpoint


@router.get("/v1/webhook_endpoints")
async def list_endpoints(services: ServicesDep) -> dict[str, Any]:
    return _page(await _hooks(services).endpoints(current_owner()))


@router.delete("/v1/webhook_endpoints/{endpoint_id}")
async def delete_endpoint(endpoint_id: EndpointId, services: ServicesDep) -> dict[str, Any]:
    """Delete it: jobs submitted from now on no longer send to it (those before still do)."""
    if not await _hooks(services).delete_endpoint(current_owner(), endpoint_id):
        raise ApiError(404, f"No webhook endpoint {endpoint_id!r}", param="endpoint_id", code="not_found")
    return {"id": endpoint_id, "object": "webhook_endpoint", "deleted": True}


@router.get("/v1/webhook_secret")
async def webhook_secret(services: ServicesDep) -> dict[str, Any]:
    """The secrets this API key's webhooks are signed with (``whsec_...``; the first is current,
    each signs during a rotation): give one to the receiver's verifier."""
    secrets = owner_secrets(await _hooks(services).server_secrets(), current_owner())
    return {"object": "webhook_secret", "secrets": secrets}
