"""A job's stream from its first event (the body of a streamed submit, on either API), and the
OpenAI view of an existing job for resuming in that format."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

from fastapi.sse import EventSourceResponse, ServerSentEvent

from api.openai_compat.chunks import View
from api.served import served_models
from api.services import Services
from api.sse import Render, event_stream, relay
from common.store import StreamState


async def openai_view(services: Services, job: StreamState) -> View:
    """How an existing job looks in the OpenAI format (for ``/v1/jobs/{id}/events?format=openai``)."""
    # The worker that took the job wrote its model's name; a queued job gets the served one's.
    model = job.model or min(await served_models(services.store), default="")
    return View.of(job.job_id, job.created_at, job.request, model)


def streamed_submit(
    services: Services, job_id: str, render: Render, foreground: bool, headers: Mapping[str, str]
) -> EventSourceResponse:
    """The answer to a streamed submit: every event of the job from the first. A foreground job's
    client counts as its watcher while it reads (closed with the response, so a client that hangs
    up stops watching at once)."""
    if foreground:
        services.watchers.check_later(job_id)  # a client that leaves before the first byte

    async def events() -> AsyncGenerator[list[ServerSentEvent], None]:
        async with services.follow(job_id, watch=foreground) as inbox:
            async for batch in relay(services.store, inbox, job_id, 0, services.settings.sse_ping_s, render):
                yield batch

    return event_stream(events(), headers)
