"""Jobs: submit, look up, cancel, and stream a job's events over SSE."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.sse import EventSourceResponse

from api.auth import current_owner
from api.deps import CursorDep, IdempotencyKey, InboxDep, JobDep, JobId, ServicesDep, StreamStateDep
from api.errors import ApiError
from api.openai_compat.stream import openai_view, streamed_submit
from api.served import check_with_live_workers
from api.services import Services
from api.sse import event_stream, relay, to_sse_list
from common.schemas import Job, JobRequest
from common.store import IdempotencyConflict, QueueFull

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

RETRY_AFTER_S = 2  # a full queue drains at the workers' pace; retrying sooner only adds load
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it; logged, never received
RECANCEL_S = 0.05  # a task that did not end this long after its cancel is cancelled again


@router.post(
    "",
    status_code=202,
    response_model=Job,
    responses={
        200: {
            "model": Job,
            "content": {"text/event-stream": {}},
            "description": "Finished (background=false), or the job's events (stream=true)",
        }
    },
)
async def create_job(
    body: JobRequest,
    services: ServicesDep,
    request: Request,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> Job | EventSourceResponse:
    """Queue a job. With ``"stream": true`` answer 200 with its events, as ``GET
    /v1/jobs/{id}/events`` would (resume there with ``Last-Event-ID``); with ``"background":
    false`` wait for it and answer 200 with the result (or, streamed, cancel it once nobody has
    watched it for ``SPOOL_DETACH_GRACE_S``).

    With an ``Idempotency-Key`` header the client used before (within ``SPOOL_JOB_TTL_S``), no
    job is created: the answer is about the job that key created, so a submit whose answer was
    lost can be sent again; the same key with another body is a 409."""
    check_with_live_workers(await services.served.get(), body)
    job = await submit_job(services, body, idempotency_key)
    location = f"/v1/jobs/{job.id}"
    if body.stream:
        return streamed_submit(services, job.id, to_sse_list, not body.background, {"Location": location})
    response.headers["Location"] = location
    if body.background:
        return job
    response.status_code = 200
    return await wait_for_job(services, job.id, request)


async def submit_job(services: Services, body: JobRequest, idempotency_key: str | None = None) -> Job:
    """Store the job with its Celery message, in one script (429 when the queue is full)."""
    metrics = services.metrics
    try:
        job = await services.store.create_job(
            body, current_owner(), services.enqueuer.generate, idempotency_key
        )
    except QueueFull as e:
        metrics.jobs_rejected.labels("queue_full").inc()
        raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except IdempotencyConflict as e:
        raise ApiError(409, str(e), param="Idempotency-Key", code="idempotency_key_reused") from None
    metrics.jobs_submitted.inc()
    return job


async def cancel_until_done(tasks: list[asyncio.Future[None]]) -> None:
    """Cancel the tasks, again and again until each has ended.

    NOTE: one cancel is not enough. A cancel that lands while a task is inside redis-py (seen in
    the hub's SUBSCRIBE of a job, a client hanging up just as its wait began: about 1 in 3 with
    an immediate hang-up) can be swallowed; the task then ran on with ``cancelling() == 1`` and
    this wait never ended, the request kept watching its job, and a foreground job whose client
    was gone ran to its end instead of being cancelled after the grace. (Starlette's streams
    are cancelled by anyio's cancel scopes, which cancel again at every await.)
    """
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)


async def wait_for_job(services: Services, job_id: str, request: Request) -> Job:
    """The job once it is final; the caller counts as a watcher meanwhile (api/openai_compat/detach.py).

    A client that hangs up stops watching at once, so a foreground job nobody else watches is
    cancelled after ``SPOOL_DETACH_GRACE_S``, as an abandoned stream's is.
    """

    async def final() -> None:
        # relay() ends after the terminal event whatever the timing, so the job is then final.
        async with services.follow(job_id, watch=False) as inbox:
            async for _ in relay(services.store, inbox, job_id, 0, services.settings.sse_ping_s):
                pass

    async def hung_up() -> None:
        # The body was read, so the next ASGI message is the disconnect (or nothing).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async with services.watchers.watch(job_id):
        waits = [asyncio.ensure_future(final()), asyncio.ensure_future(hung_up())]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_until_done(waits)
            await asyncio.gather(*waits, return_exceptions=True)  # their ends, errors included, seen
        if waits[0] not in done:
            raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed_request")
        waits[0].result()  # relay's errors (Redis unreachable) go to their handlers
    return await services.store.get_job(job_id)


@router.get("/{job_id}")
async def get_job(job: JobDep) -> Job:
    return job


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: JobId, services: ServicesDep) -> Job:
    """Idempotent; a queued job ends at once, a running one at the worker's next step.

    A job that already succeeded or failed answers 409 (the store checks atomically).
    """
    services.metrics.jobs_cancelled.inc()
    return await services.store.request_cancel(job_id)


# NOTE: no response_class=EventSourceResponse here: with it FastAPI expects a yield endpoint.
@router.get(
    "/{job_id}/events",
    responses={200: {"content": {"text/event-stream": {}}, "description": "The job's events"}},
)
async def job_events(
    job: StreamStateDep,
    cursor: CursorDep,
    inbox: InboxDep,
    services: ServicesDep,
    format: Literal["spool", "openai"] = "spool",
) -> EventSourceResponse:
    """Events after the cursor (``Last-Event-ID`` or ``?after=``), ending with done or error.

    ``?format=openai``: the same ids, as OpenAI stream chunks ending with ``data: [DONE]``.
    """
    render = to_sse_list if format == "spool" else (await openai_view(services, job)).render
    return event_stream(relay(services.store, inbox, job.job_id, cursor, services.settings.sse_ping_s, render))
