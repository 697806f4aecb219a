"""OpenAI's Batches API on the job queue: create, retrieve, list, cancel.

Creating a batch only stores it (``validating``); the feeder (api/batch_feeder.py), which every
API process runs and one at a time works, validates its input file, feeds its lines to the queue
as jobs below interactive traffic, counts them as they end and writes its output and error files.

The feeder's steps: docs/internals.md#batches-apibatch_feederpy.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from api.auth import current_owner
from api.deps import ServicesDep, owned_batch, owned_file
from api.errors import ApiError
from api.openai_compat.batches import COMPLETION_WINDOWS, ENDPOINTS, page
from api.services import Services
from api.submission import check_webhook
from common.keys import Keys
from common.schemas.views import batch_object
from common.store.hooks import hook_field
from common.webhooks import BATCH_EVENTS

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BatchId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
MAX_METADATA = 16  # key-value pairs, as OpenAI's metadata


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=MAX_METADATA)
    # Spool's: where to POST the batch's end (docs/webhooks.md), and which ends (default: all).
    webhook: str | None = None
    webhook_events: list[str] | None = None


def new_batch_id(keys: Keys, owner: str) -> str:
    """A new batch's id, in its owner's bucket, with its files (common/keys.py)."""
    return keys.new_id("batch_", 16, keys.owner_bucket(owner))


@router.post("")
async def create_batch(body: BatchRequest, services: ServicesDep) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_endpoint"
        )
    window_s = COMPLETION_WINDOWS.get(body.completion_window)
    if window_s is None:
        raise ApiError(
            400,
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
            param="completion_window",
        )
    f = await owned_file(services.batches, body.input_file_id)
    if f["purpose"] != "batch":
        raise ApiError(
            400, f"file {f['id']!r} has purpose {f['purpose']!r}, not 'batch'", param="input_file_id"
        )
    await _check_webhook(services, body)
    now = time.time()
    fields = {
        "id": new_batch_id(services.settings.keys, current_owner()),
        "status": "validating",
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "created_at": repr(now),
        "expires_at": repr(now + window_s),
        "metadata": json.dumps(body.metadata) if body.metadata is not None else "",
        "owner": current_owner(),
        "completed": "0",
        "failed": "0",
    }
    if body.webhook is not None:
        settings, owner = services.settings, current_owner()
        events = list(body.webhook_events or BATCH_EVENTS)
        fields["hook"] = hook_field(
            settings.keys, settings, "batch", fields["id"], body.webhook, events, owner
        )
    await services.batches.create_batch(fields)
    return batch_object(fields)


async def _check_webhook(services: Services, body: BatchRequest) -> None:
    """400 for a bad webhook or events (as a job's: api/submission.py ``check_webhook``)."""
    events = body.webhook_events
    if events is not None and (body.webhook is None or not events or not set(events) <= set(BATCH_EVENTS)):
        raise ApiError(
            400,
            f"webhook_events needs a webhook, and names some of {', '.join(BATCH_EVENTS)}",
            param="webhook_events",
            code="invalid_webhook",
        )
    if body.webhook is not None:
        await check_webhook(services, body.webhook)


@router.get("/{batch_id}")
async def retrieve_batch(batch_id: BatchId, services: ServicesDep) -> dict[str, Any]:
    return batch_object(await owned_batch(services.batches, batch_id))


@router.get("")
async def list_batches(
    services: ServicesDep, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> dict[str, Any]:
    """The batches, newest first, ``limit`` at a time after the one named ``after``."""
    batches = [batch_object(h) for h in await services.batches.list_batches(current_owner())]
    return page(batches, after, limit)


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: BatchId, services: ServicesDep) -> dict[str, Any]:
    """cancelling at once; cancelled once its running lines stopped (finished lines are kept).

    Idempotent; a batch that already ended otherwise (or is writing its files) answers 409."""
    store = services.batches
    await owned_batch(store, batch_id)
    was = await store.end_batch(batch_id, "cancelled")
    if was not in ("validating", "in_progress", "cancelling", "cancelled"):
        raise ApiError(
            409,
            f"batch {batch_id!r} is {was}: it can no longer be cancelled",
            param="batch_id",
            code="conflict",
        )
    return batch_object(await owned_batch(store, batch_id))
