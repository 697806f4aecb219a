"""Dependencies as ``Annotated`` aliases: routes declare what they need by type."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Body, Depends, Header, Path, Query, Request
from pydantic import PlainValidator, ValidationError

from api.auth import current_owner
from api.errors import ApiError, body_errors
from api.hub import Inbox
from api.services import Services
from common.schemas.requests import JobRequest
from common.schemas.views import Job
from common.store import AsyncBatchStore, AsyncJobStore, StreamState


# NOTE: async, like every dependency here: FastAPI runs a plain `def` dependency in its thread
# pool, a thread hop per request for a dictionary lookup.
async def _services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(_services)]


async def _store(services: ServicesDep) -> AsyncJobStore:
    return services.store


StoreDep = Annotated[AsyncJobStore, Depends(_store)]

JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]

# Printable ASCII without spaces, as the IETF draft's examples and Stripe's keys (UUIDs).
IdempotencyKey = Annotated[
    str | None,
    Header(
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Sent again with the same body within SPOOL_JOB_TTL_S, answers with the job the "
        "first submit made instead of making another (409 with another body).",
    ),
]


# NOTE: FastAPI validates a body without a validation context, so it only parses this one's JSON
# (the OpenAPI document still shows JobRequest's schema), and _job_request validates it with the
# app's settings.
_JobRequestJson = Annotated[Any, Body(), PlainValidator(lambda v: v, json_schema_input_type=JobRequest)]


async def _job_request(body: _JobRequestJson, services: ServicesDep) -> JobRequest:
    try:
        return JobRequest.accept(body, services.settings)
    except ValidationError as e:
        raise body_errors(e) from None


JobRequestDep = Annotated[JobRequest, Depends(_job_request)]


async def _job(job_id: JobId, store: StoreDep) -> Job:
    return await store.get_job(job_id)  # JobNotFound becomes the 404 envelope (api/errors.py)


JobDep = Annotated[Job, Depends(_job)]


async def _stream_state(job_id: JobId, store: StoreDep) -> StreamState:
    # Not JobDep: that also reads the job's text, which a stream does not need.
    return await store.stream_state(job_id)


StreamStateDep = Annotated[StreamState, Depends(_stream_state)]


async def _cursor(
    state: StreamStateDep,
    services: ServicesDep,
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[int | None, Query(ge=0)] = None,
) -> int:
    # A browser's EventSource reconnects to the same URL and adds Last-Event-ID, so the header
    # is the fresher cursor when both are present. An empty one names no event (the SSE spec's
    # "no last event id"): as if absent.
    header = (last_event_id or "").strip()
    if header and not (header.isascii() and header.isdigit() and len(header) <= 18):
        raise ApiError(
            400,
            f"Last-Event-ID must be an event id (an integer, 0 or more), not {header[:40]!r}",
            param="Last-Event-ID",
            code="invalid_cursor",
        )
    cursor = int(header) if header else (after or 0)
    if cursor > state.log_length:
        # Ids come from the log, so a larger one was never sent; honouring it would hang.
        raise ApiError(
            400,
            f"Event id {cursor} is past the job's last event",
            param="Last-Event-ID",
            code="invalid_cursor",
        )
    if cursor:
        services.metrics.sse_resumes.inc()
    return cursor


CursorDep = Annotated[int, Depends(_cursor)]


async def _inbox(state: StreamStateDep, services: ServicesDep) -> AsyncIterator[Inbox]:
    # A dependency, not a ``with`` inside the stream's generator: FastAPI closes dependencies
    # when the request ends, while a generator abandoned by a client that hung up is only
    # finalized whenever the garbage collector gets to it, leaving its subscription behind.
    if state.status.terminal:
        # Its log already ends with the terminal event: nothing will come live.
        yield Inbox()
        return
    # Only a foreground job still running is cancelled when nobody watches it (api/watchers.py).
    async with services.follow(state.job_id, watch=state.foreground_and_live) as inbox:
        yield inbox


InboxDep = Annotated[Inbox, Depends(_inbox)]


async def owned_file(store: AsyncBatchStore, file_id: str) -> dict[str, str]:
    """A file's stored object; 404 for an unknown id or another API key's file (api/routes/files.py)."""
    h = await store.get_file(file_id)
    if h is None or h.get("owner", "") != current_owner():
        raise ApiError(
            404, f"No file with id {file_id!r} (unknown, or expired)", param="file_id", code="file_not_found"
        )
    return h


async def owned_batch(store: AsyncBatchStore, batch_id: str) -> dict[str, str]:
    """A batch's hash; 404 for an unknown id or another API key's batch (api/routes/batches.py)."""
    h = await store.get_batch(batch_id)
    if h is None or h.get("owner", "") != current_owner():
        raise ApiError(
            404,
            f"No batch with id {batch_id!r} (unknown, or expired)",
            param="batch_id",
            code="batch_not_found",
        )
    return h
