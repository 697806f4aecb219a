"""A job's stream from its first event (the body of a streamed submit, on either API), and the
OpenAI view of an existing job for resuming in that format."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from fastapi.sse import ServerSentEvent

from api.openai_compat.chunks import View
from api.served import served_models
from api.services import Services
from api.sse import Render, relay
from common.store import StreamState


async def openai_view(services: Services, job: StreamState) -> View:
    """How an existing job looks in the OpenAI format (for ``/v1/jobs/{id}/events?format=openai``)."""
    # The worker that took the job wrote its model's name; a queued job gets the served one's.
    model = job.model or min(await served_models(services.store), default="")
    return View.of(job.job_id, job.created_at, job.request, model)


async def stream_body(
    services: Services, job_id: str, render: Render, foreground: bool
) -> AsyncGenerator[list[ServerSentEvent], None]:
    """Every event of the job from the first; a foreground job's client counts as its watcher."""
    watching = services.watchers.watch(job_id) if foreground else contextlib.nullcontext()
    async with watching:
        with services.hub.watch(job_id) as inbox:  # subscribed before relay() reads the log
            async for batch in relay(services.store, inbox, job_id, 0, services.settings.sse_ping_s, render):
                yield batch
