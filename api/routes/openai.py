"""The OpenAI API on the job queue: /v1/completions, /v1/chat/completions, /v1/images/generations
and /v1/models.

Each request becomes a job like any other (batched, stored, resumable); the response carries its
id in ``X-Spool-Job-Id``, and ``/v1/jobs/{id}/events?format=openai`` resumes its stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.deps import ServicesDep, StoreDep
from api.errors import ApiError
from api.openai_compat.chunks import View
from api.openai_compat.images import ImageGenerationRequest, ImageStreamView, failure, image_data
from api.openai_compat.requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from api.served import check_media_workers, check_servable, resolve_model, served
from api.services import Services
from api.submission import streamed_submit, submit_job, wait_for_job
from common.schemas.views import JobStatus, WorkerHeartbeat

router = APIRouter(prefix="/v1", tags=["openai"])

JOB_ID_HEADER = "X-Spool-Job-Id"


@router.post("/completions")
async def completions(body: CompletionRequest, services: ServicesDep, http: Request) -> Response:
    return await _serve(body, services, http)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, services: ServicesDep, http: Request) -> Response:
    return await _serve(body, services, http)


@router.post("/images/generations")
async def images_generations(body: ImageGenerationRequest, services: ServicesDep, http: Request) -> Response:
    """Images from a prompt, as OpenAI's Images API. It is one job with ``n`` image parts, answered
    once they are done (``b64_json``, or a ``url`` of the part's content on this API until the job
    expires), or with ``stream`` as its events (partial images, then the image)."""
    request = body.to_job_request(services.settings)
    async with _write_refused_first(services):
        await check_media_workers(services.served, request)  # it waits for the images
    if body.model is not None:
        models = sorted(await services.served.media())
        if body.model not in models:
            raise ApiError(
                404,
                f"The image model {body.model!r} does not exist; "
                f"this server serves {', '.join(map(repr, models))}",
                param="model",
                code="model_not_found",
            )
    job = await submit_job(services, request, services.settings.served_model)  # no text part: any model
    headers = {JOB_ID_HEADER: job.id}
    if body.stream:
        view = ImageStreamView.of(services.store, job.id, job.created_at, request)
        return streamed_submit(services, job.id, view.stream, True, headers)
    job = await wait_for_job(services, job.id, http)
    if job.status is not JobStatus.SUCCEEDED:
        err = failure(job)
        err.headers.update(headers)
        raise err
    b64 = body.response_format == "b64_json"
    contents = [await services.store.part_content(job.id, p["index"]) for p in job.parts] if b64 else []
    data = image_data(job, str(http.base_url), contents, b64)
    return JSONResponse({"created": int(job.created_at), "data": data}, headers=headers)


@router.get("/models")
async def list_models(store: StoreDep) -> dict[str, Any]:
    """The models the live workers serve (empty while no worker runs), each with ``workers``: how
    many live workers serve it."""
    workers = await store.list_workers()
    return {"object": "list", "data": [_model(w, workers) for w in served(workers).values()]}


@router.get("/models/{model:path}")
async def retrieve_model(model: str, store: StoreDep) -> dict[str, Any]:
    workers = await store.list_workers()
    return _model(resolve_model(served(workers), model), workers)


@asynccontextmanager
async def _write_refused_first(services: Services) -> AsyncIterator[None]:
    """No live worker while Redis refuses writes (out of memory): the heartbeats could not be
    written, so the refusal (503 redis_write_refused, as /v1/jobs answers) says why, not no_worker."""
    try:
        yield
    except ApiError as e:
        if e.code == "no_worker":
            await services.store.probe_write()
        raise


def _model(worker: WorkerHeartbeat, workers: list[WorkerHeartbeat]) -> dict[str, Any]:
    # NOTE: a served model has no creation date of its own; like vLLM, answer with the time now.
    return {
        "id": worker.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "spool",
        "max_model_len": worker.max_model_len,
        "workers": sum(w.kind == "text" and w.model == worker.model for w in workers),
        # What it serves: ["embeddings"] (/v1/embeddings, in these sizes), else ["completions",
        # "chat.completions"] (the chat only with a chat template).
        "capabilities": _capabilities(worker),
        "embedding_dimensions": worker.embedding_dimensions,
    }


def _capabilities(worker: WorkerHeartbeat) -> list[str]:
    if worker.embedding_dimensions is not None:
        return ["embeddings"]
    return ["completions"] + ([] if worker.chat_template is False else ["chat.completions"])


async def _serve(body: OpenAIRequest, services: ServicesDep, http: Request) -> Response:
    request = body.to_job_request(services.settings)
    async with _write_refused_first(services):
        worker = resolve_model(await services.served.get(), body.model)
    check_servable(request, worker)
    prompt_tokens = await services.context.check(request, worker)
    job = await submit_job(services, request, worker.model)
    view = View.of(job.id, job.created_at, request, worker.model, worker.tool_parser, prompt_tokens)
    headers = {JOB_ID_HEADER: job.id}
    if body.stream:
        render = tools.render if (tools := view.tool_stream()) else view.render
        return streamed_submit(services, job.id, render, not request.background, headers)
    try:
        done = await wait_for_job(services, job.id, http)
        log = await services.store.read_log(job.id) if view.needs_log else []
        return JSONResponse(view.completion(done, log), headers=headers)
    except ApiError as e:
        e.headers.update(headers)
        raise
