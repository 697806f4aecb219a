"""Jobs: submit, look up, cancel, and stream a job's events over SSE.

The path of a job, from its submit to its stream: docs/internals.md#the-path-of-one-token.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.sse import EventSourceResponse

from api.auth import current_owner
from api.deps import (
    CursorDep,
    IdempotencyKey,
    InboxDep,
    JobDep,
    JobId,
    JobRequestDep,
    ServicesDep,
    StoreDep,
    StreamStateDep,
)
from api.errors import ApiError
from api.openai_compat.chunks import View
from api.openai_compat.images import ImageStreamView
from api.served import (
    check_media_workers,
    check_with_live_workers,
    queue_model,
    served_models,
    waiting_reason,
)
from api.services import Services
from api.sse import AsyncRender, Render, event_stream, rendered, to_sse_list
from api.submission import streamed_submit, submit_job, wait_for_job
from common.schemas.views import Job, JobList, JobStatus
from common.store import JobNotFound, StreamState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

READY_HEADER = "X-Spool-Ready"  # on a submit: "false" while no worker is live (the job waits in the queue)


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
    body: JobRequestDep,
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
    models = await services.served.get()
    check_with_live_workers(models, body)
    await services.context.check_live(body, models)
    await check_media_workers(services.served, body)
    job = await submit_job(
        services,
        body,
        await queue_model(services.store, models, body.model, body.embed is not None),
        idempotency_key,
    )
    # A job is queued whether or not a worker is live (it waits for one); this says which.
    headers = {"Location": f"/v1/jobs/{job.id}", READY_HEADER: "true" if models else "false"}
    if body.stream:
        return streamed_submit(services, job.id, to_sse_list, not body.background, headers)
    response.headers.update(headers)
    if body.background:
        return job
    response.status_code = 200
    return await wait_for_job(services, job.id, request)


@router.get("")
async def list_jobs(
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    status: JobStatus | None = None,
    batch_lines: bool = True,
) -> JobList:
    """The jobs of the caller's API key (without keys: every job), newest first, without their
    text. ``after``: the ``last_id`` of the page before; ``status``: only jobs in that state;
    ``batch_lines=false``: without the jobs of batches' lines (those have a ``batch_id``)."""
    return await store.list_jobs(current_owner(), limit, after, status, batch_lines)


@router.get("/{job_id}")
async def get_job(job: JobDep, services: ServicesDep) -> Job:
    if job.status is not JobStatus.QUEUED:
        return job
    store = services.store
    position = await store.queue_position(job.id)
    estimate = await store.estimated_start_s(job.id, position) if position is not None else None
    reason = await waiting_reason(store, await services.served.get(), job.id)
    return job.model_copy(
        update={"queue_position": position, "estimated_start_s": estimate, "waiting_reason": reason}
    )


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: JobId, services: ServicesDep) -> Job:
    """Idempotent; a queued job ends at once, a running one at the worker's next step.

    A job that already succeeded or failed answers 409 (the store checks atomically).
    """
    services.metrics.jobs_cancelled.inc()
    return await services.store.request_cancel(job_id)


@router.get(
    "/{job_id}/parts/{index}/content",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}, "description": "The image part's PNG"}},
)
async def part_content(
    job_id: JobId, index: Annotated[int, Path(ge=0, le=1 << 16)], store: StoreDep
) -> Response:
    """An image part's bytes, from any replica, until the job expires (404 before the part succeeded)."""
    data = await store.part_content(job_id, index)
    if data is None:
        if await store.owner(job_id) is None:
            raise JobNotFound(job_id)
        raise ApiError(
            404,
            f"Part {index} of job {job_id!r} has no content: not an image part, not succeeded, or expired",
            param="index",
            code="content_not_found",
        )
    return Response(data, media_type="image/png")


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

    ``?format=openai``: the same ids, as OpenAI stream chunks ending with ``data: [DONE]`` (a job
    of image parts: as the Images API's stream events).
    """
    render = to_sse_list if format == "spool" else await _openai_render(services, job, cursor)
    return event_stream(
        rendered(services.store, inbox, job.job_id, cursor, services.settings.sse_ping_s, render)
    )


async def _openai_render(services: Services, job: StreamState, cursor: int) -> Render | AsyncRender:
    """How an existing job streams in the OpenAI format, after ``cursor``."""
    parts = job.request.parts
    if parts and all(p.type == "image" for p in parts):
        return ImageStreamView.of(services.store, job.job_id, job.created_at, job.request).stream
    # The worker that took the job wrote its model's name; a queued job gets the one it names,
    # else the served one's.
    served = await served_models(services.store)
    model = job.model or job.request.model or min(served, default="")
    worker = served.get(model) or next(iter(served.values()), None)
    prompt_tokens = None
    if job.request.stream_continuous_usage and worker is not None:
        prompt_tokens = await services.context.count(job.request, worker)
    view = View.of(
        job.job_id, job.created_at, job.request, model, worker.tool_parser if worker else None, prompt_tokens
    )
    tools = view.tool_stream()
    if tools is None and view.running_usage is None:
        return view.render
    had = [e for e in await services.store.read_log(job.job_id) if e.seq <= cursor]
    if tools is None:
        for entry in had:  # the usage so far counts the tokens the client already had
            view.render(entry)
        return view.render
    tools.prime(had)
    return tools.render
