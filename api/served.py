"""Which model is served, and what it can take, read from the workers' heartbeats.

The API loads no model, so it learns the model's facts (its name, whether it has a chat
template, its max_model_len, the tokenizer spec the worker stored) from the heartbeats and
refuses what the model cannot serve before a job is queued (a request too long for its
context: api/context_length.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from api.errors import ApiError
from common.schemas.requests import JobRequest
from common.schemas.views import WorkerHeartbeat
from common.settings import model_name
from common.store import AsyncJobStore

NO_WORKER_RETRY_S = 2


async def served_models(store: AsyncJobStore) -> dict[str, WorkerHeartbeat]:
    """One heartbeat per served (text) model name, from the workers that are alive now."""
    return served(await store.list_workers())


def served(workers: list[WorkerHeartbeat]) -> dict[str, WorkerHeartbeat]:
    """One heartbeat per text model name among these workers'."""
    return {w.model: w for w in sorted(workers, key=lambda w: w.name) if w.kind == "text"}


async def check_media_workers(served: ServedModels, request: JobRequest) -> None:
    """A request that waits for image parts (``background: false``, or a stream) needs a live
    media worker: without one it would wait for good (a background job is queued, as any job)."""
    has_images = any(p.type == "image" for p in request.parts or ())
    if has_images and (not request.background or request.stream) and not await served.media():
        raise ApiError(
            503,
            "No media worker is running (no live heartbeat of `spool worker --kind media`); retry later",
            code="no_worker",
            headers={"Retry-After": str(NO_WORKER_RETRY_S)},
        )


class ServedModels:
    """What the live workers serve, for the submit paths: the text models (``served_models``) and
    the image pipelines. They are read from Redis at most once per ``ttl_s`` per API process while
    a worker of the kind asked about is live. So a burst of submissions reads the heartbeats once,
    not once per request (two Redis round trips and a parse of every heartbeat).

    An empty answer is never kept, so the first worker of a kind to start is seen at once; any
    other change among the live workers (one more, one fewer) within ``ttl_s``. A request checked
    against a worker that just died is queued, as it would have been a moment earlier, and the
    next worker takes it (or refuses what its model cannot take).
    """

    def __init__(self, store: AsyncJobStore, ttl_s: float = 1.0) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._text: dict[str, WorkerHeartbeat] = {}  # one heartbeat per text model, as served_models
        self._media: frozenset[str] = frozenset()  # the media workers' pipelines
        self._until = 0.0  # monotonic time the kept answer expires
        self._lock = asyncio.Lock()  # one read at a time: a burst waits for it, not reads too

    async def get(self) -> dict[str, WorkerHeartbeat]:
        """The text models."""
        await self._read_unless(lambda: bool(self._text))
        return self._text

    async def media(self) -> frozenset[str]:
        """The image pipelines."""
        await self._read_unless(lambda: bool(self._media))
        return self._media

    async def _read_unless(self, kept: Callable[[], bool]) -> None:
        if time.monotonic() < self._until and kept():
            return
        async with self._lock:
            if time.monotonic() >= self._until or not kept():
                workers = await self._store.list_workers()
                self._text = served(workers)
                self._media = frozenset(w.model for w in workers if w.kind == "media")
                self._until = time.monotonic() + self._ttl_s


def served_name(models: Mapping[str, WorkerHeartbeat], requested: str) -> str:
    """The name ``requested`` is served under: itself, or for the path of a model directory
    (the id such a model had before it was named by its directory) that directory's name."""
    if requested in models:
        return requested
    name = model_name(requested)
    return name if name in models else requested


def resolve_model(
    models: Mapping[str, WorkerHeartbeat], requested: str | None, embed: bool = False
) -> WorkerHeartbeat:
    """The served model a request names; when it names none, the first in order of those that
    generate (``embed``: that embed), else of all."""
    if not models:
        raise ApiError(
            503,
            "No worker is serving a model right now (no live heartbeat); retry later",
            code="no_worker",
            headers={"Retry-After": str(NO_WORKER_RETRY_S)},
        )
    if requested is None:
        fit = [m for m, w in models.items() if (w.embedding_dimensions is not None) == embed]
        return models[min(fit or models)]
    requested = served_name(models, requested)
    if requested not in models:
        raise ApiError(
            404,
            f"The model {requested!r} does not exist; this server serves {', '.join(map(repr, models))}",
            param="model",
            code="model_not_found",
        )
    return models[requested]


async def queue_model(
    store: AsyncJobStore, models: Mapping[str, WorkerHeartbeat], requested: str | None, embed: bool = False
) -> str:
    """The model a job is queued for; its messages go to that model's queue (Keys.model_queue).

    It is the model the request names. Otherwise it is the one ``resolve_model`` picks among
    ``models``, the live workers'. With none live (they restart, or Redis did and their heartbeats
    are not back yet), it is the one served last within ``WORKER_FORGET_S``, so the job waits where
    the workers will look; with none served in that time, this server's (SPOOL_SERVED_MODEL_NAME,
    else SPOOL_MODEL). A job left queued for a model whose workers do not come back is moved or
    failed by a live worker's sweep after SPOOL_UNSERVED_GRACE_S (workers/reaper.py)."""
    if requested is not None:
        return served_name(models, requested)
    if models:
        return resolve_model(models, None, embed).model
    # NOTE: the one served last, not the first in order: a model whose workers left long ago
    # must not win over one whose worker beat a moment ago (it restarts, or its beat is late).
    stamps = await store.served_stamps()
    return max(stamps, key=lambda m: (stamps[m], m)) if stamps else store.settings.served_model


async def waiting_reason(
    store: AsyncJobStore, models: Mapping[str, WorkerHeartbeat], job_id: str
) -> str | None:
    """Why a queued text job waits when no live worker serves the model it is queued for (None
    when one does: it waits its turn, ``queue_position``)."""
    keys = store.settings.keys
    queue, named = await store.queued_for(job_id)
    if not queue or queue == keys.queue_media or queue in {keys.model_queue(m) for m in models}:
        return None
    names = {keys.model_queue(m): m for m in [*await store.recent_models(), store.settings.served_model]}
    model = names.get(queue, named)
    then = (
        "it then fails with model_not_served"
        if named is not None
        else "it named no model, so it then moves to a model a live worker serves"
    )
    grace = store.settings.unserved_grace_s
    return (
        f"No live worker serves the model {model!r} this job is queued for; it waits for one, for "
        f"{grace:g} s after that model's last heartbeat at most (SPOOL_UNSERVED_GRACE_S): {then}"
    )


async def queued_models(store: AsyncJobStore) -> set[str]:
    """The models whose queues may hold jobs: those served within ``WORKER_FORGET_S``, and the default."""
    return set(await store.recent_models()) | {store.settings.served_model}


def live_worker(models: Mapping[str, WorkerHeartbeat], request: JobRequest) -> WorkerHeartbeat | None:
    """A live worker of the model a job runs on (``resolve_model``: 404 for a model no live worker
    serves); None while no worker is live (the job is queued for the model it names, or the default)."""
    return resolve_model(models, request.model, request.embed is not None) if models else None


def check_with_live_workers(models: Mapping[str, WorkerHeartbeat], request: JobRequest) -> None:
    """``check_servable`` against the job's model, when a live worker says what it is.

    A job may also be queued while no worker runs (they restart, or scale from zero); the
    worker then refuses what its model cannot take, and the job fails with the reason.
    """
    if (worker := live_worker(models, request)) is not None:
        for text in text_requests(request):
            check_servable(text, worker)


def text_requests(request: JobRequest) -> list[JobRequest]:
    """What the text model runs of a request: itself, or its text parts."""
    if request.parts is None:
        return [request]
    return [r for k in range(len(request.parts)) if isinstance(r := request.part_request(k), JobRequest)]


def check_servable(request: JobRequest, worker: WorkerHeartbeat) -> None:
    """Refuse, before queueing, what the served model cannot take."""
    check_embeds(request, worker)
    if request.messages is not None and worker.chat_template is False:
        raise ApiError(
            400,
            f"The model {worker.model!r} has no chat template, so it cannot render messages; "
            "use /v1/completions with a prompt",
            param="messages",
            code="no_chat_template",
        )
    if request.tools_on and worker.chat_template is not None and worker.tool_parser is None:
        raise ApiError(
            400,
            f"The model {worker.model!r} takes no tools: its chat template renders none, or no tool "
            "parser reads its calls (the worker's SPOOL_TOOL_PARSER)",
            param="tools",
            code="tools_not_supported",
        )
    # Whether the request fits the model's context is api/context_length.py's check (it counts tokens).


def check_embeds(request: JobRequest, worker: WorkerHeartbeat) -> None:
    """An embedding job needs a model that embeds, in a size it gives; a model that embeds
    generates nothing."""
    sizes = worker.embedding_dimensions
    if request.embed is None:
        if sizes is not None:
            raise ApiError(
                400,
                f"The model {worker.model!r} embeds and does not generate text; use /v1/embeddings",
                param="model",
                code="model_not_generative",
            )
        return
    if sizes is None:
        raise ApiError(
            400,
            f"The model {worker.model!r} does not embed; it generates text (/v1/models lists what each "
            "model does)",
            param="model",
            code="model_not_embedding",
        )
    dims = request.embed.dimensions
    if dims is not None and dims not in sizes:
        given = ", ".join(map(str, sizes))
        raise ApiError(
            400,
            f"dimensions {dims} is not one the model {worker.model!r} gives: {given} (a truncation "
            "needs a model trained for it; the worker's SPOOL_EMBEDDING_DIMENSIONS)",
            param="dimensions",
            code="unsupported_dimensions",
        )
