"""OpenAI's Responses API on the job queue (api/openai_compat/responses.py says how it maps).

A response belongs to the API key that created it: any other key gets the 404 of an unknown id.
Background responses run whether or not anyone is connected; any replica polls, streams (from
any ``starting_after``), cancels or deletes them until the job expires (``SPOOL_JOB_TTL_S``).

The record and the stream's numbering:
docs/internals.md#responses-apiroutesresponsespy-apiopenai_compatresponsespy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import ServerSentEvent

from api.auth import current_owner
from api.deps import ServicesDep
from api.errors import ApiError
from api.openai_compat.chunks import failure
from api.openai_compat.response_record import ResponseRecord, item_text, job_id_of
from api.openai_compat.response_request import ResponseRequest
from api.openai_compat.responses import ResponseView
from api.served import check_servable, resolve_model
from api.services import Services
from api.sse import AsyncRender, Chunk
from api.submission import followed_stream, streamed_submit, submit_job, until_final, wait_for_job
from common.schemas.events import LogEntry
from common.schemas.views import Job, JobError, JobStatus, Usage
from common.store import AsyncJobStore, Conflict, JobNotFound

router = APIRouter(prefix="/v1/responses", tags=["openai"])

JOB_ID_HEADER = "X-Spool-Job-Id"
CANCEL_WAIT_S = 10.0  # how long a cancel waits for a running response to end (the worker's next step)


@router.post("")
async def create_response(body: ResponseRequest, services: ServicesDep, http: Request) -> Response:
    body.check()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = await _history(services.store, body.previous_response_id)
    worker = resolve_model(await services.served.get(), body.model)
    record = body.record(worker.model, history)
    record.tool_parser = worker.tool_parser
    request = body.to_job_request(services.settings, record.messages())
    check_servable(request, worker)
    await services.context.check(request, worker)
    job = await submit_job(services, request, worker.model)
    record.created_at = job.created_at
    await services.store.put_response(job.id, record.model_dump_json())
    view = ResponseView(job.id, record)
    headers = {JOB_ID_HEADER: job.id}
    if body.stream:
        prelude = view.opening_events(-1)
        return streamed_submit(
            services, job.id, _render(services.store, view, -1), not body.background, headers, prelude
        )
    if body.background:
        return JSONResponse(view.obj(job), headers=headers)
    try:
        done = await wait_for_job(services, job.id, http)
    except ApiError as e:
        e.headers.update(headers)
        raise
    if done.error is not None and done.error.type in (
        "request_too_long",
        "invalid_request",
        "guide_too_expensive",
    ):
        err = failure(done.error, "input")
        err.headers.update(headers)
        raise err
    return JSONResponse(view.obj(done), headers=headers)


@router.get("/{response_id}")
async def retrieve_response(
    response_id: str,
    services: ServicesDep,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    """The response; with ``stream=true`` its events after ``starting_after`` (a
    ``sequence_number``), live while it runs."""
    view = await _load(services.store, response_id)
    if not stream:
        return JSONResponse(view.obj(await services.store.get_job(view.job_id)))
    after = starting_after
    state = await services.store.stream_state(view.job_id)
    if after > view.last_event_at_most(state.log_length):
        raise ApiError(
            400,
            f"starting_after {after} is past the response's last event",
            param="starting_after",
            code="invalid_cursor",
        )
    if after > -1:
        services.metrics.sse_resumes.inc()
    return followed_stream(
        services,
        view.job_id,
        _render(services.store, view, after),
        view.cursor(after, state.log_length),
        state.foreground_and_live,
        prelude=view.opening_events(after),
    )


@router.post("/{response_id}/cancel")
async def cancel_response(response_id: str, services: ServicesDep) -> dict[str, Any]:
    """Cancel a background response; idempotent (a finished one answers with its final object)."""
    view = await _load(services.store, response_id)
    if not view.record.background:
        raise ApiError(
            400, "Only responses created with background: true can be cancelled", param="response_id"
        )
    await _cancel(services, view.job_id)
    return view.obj(await services.store.get_job(view.job_id))


@router.delete("/{response_id}")
async def delete_response(response_id: str, services: ServicesDep) -> dict[str, Any]:
    """Delete the response (a running one is cancelled first)."""
    view = await _load(services.store, response_id)
    with contextlib.suppress(Conflict, JobNotFound):
        await services.store.request_cancel(view.job_id)
    await services.store.forget_response(view.job_id)
    return {"id": view.id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items")
async def input_items(
    response_id: str,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The response's input items (those of ``previous_response_id`` first, in ``asc`` order)."""
    view = await _load(services.store, response_id)
    r = view.record
    items = [{"id": f"msg_{view.job_id}_{i}", **item} for i, item in enumerate([*r.history, *r.input])]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise ApiError(404, f"No input item with id {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _not_found(resp_id: str) -> ApiError:
    return ApiError(
        404, f"No response with id {resp_id!r} (unknown, or expired)", param="response_id", code="not_found"
    )


async def _load(store: AsyncJobStore, resp_id: str) -> ResponseView:
    """The caller's stored response (404 for any other)."""
    job_id = job_id_of(resp_id)
    if job_id is None:
        raise _not_found(resp_id)
    owner, raw = await store.response_of(job_id)
    if raw is None or owner != current_owner():
        raise _not_found(resp_id)
    record = ResponseRecord.model_validate_json(raw)
    if not record.store:
        raise _not_found(resp_id)
    return ResponseView(job_id, record)


async def _history(store: AsyncJobStore, previous: str) -> list[dict[str, Any]]:
    """The conversation a response continues: the earlier one's, its input and its output."""
    try:
        view = await _load(store, previous)
    except ApiError as e:
        e.param = "previous_response_id"
        raise
    job = await store.get_job(view.job_id)
    if not job.status.terminal:
        raise ApiError(
            400,
            f"Response {previous!r} is still {job.status.value}; continue it once it ended",
            param="previous_response_id",
        )
    r = view.record
    output = [i for i in view.obj(job)["output"] if i["type"] == "function_call" or item_text(i)]
    return [*r.history, *r.input, *output]


async def _cancel(services: Services, job_id: str) -> None:
    """Cancel the job and wait (a while) for it to end."""
    with contextlib.suppress(Conflict):  # it ended otherwise meanwhile
        await services.store.request_cancel(job_id)
    services.metrics.jobs_cancelled.inc()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CANCEL_WAIT_S):
            await until_final(services, job_id)


def _render(store: AsyncJobStore, view: ResponseView, after: int) -> AsyncRender:
    """The stream's events from log entries; a terminal entry reads the job for its text."""
    events = view.events(after)

    async def render(items: Sequence[LogEntry | ServerSentEvent]) -> list[Chunk]:
        out: list[Chunk] = []
        for item in items:
            if isinstance(item, ServerSentEvent):
                out.append(item)
                continue
            job = _as_ended(await store.get_job(view.job_id), item) if item.terminal else None
            out += events.of(item, job)
        return out

    return AsyncRender(render)


def _as_ended(job: Job, entry: LogEntry) -> Job:
    """The job as its terminal entry says it ended (the entry is the truth, whatever the hash)."""
    if entry.type == "error":
        error = JobError(message=entry.data["message"], type=entry.data["type"])
        return job.model_copy(update={"status": JobStatus.FAILED, "error": error})
    return job.model_copy(
        update={
            "status": JobStatus(entry.data["status"]),
            "finish_reason": entry.data["finish_reason"],
            "usage": Usage.model_validate(entry.data["usage"]),
        }
    )
