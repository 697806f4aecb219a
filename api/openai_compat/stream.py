"""OpenAI-format streams of a job: the body of a streamed request, and the view for resuming."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi.sse import ServerSentEvent

from api.openai_compat.chunks import View
from api.served import served_models
from api.services import Services
from api.sse import relay
from common.store import StreamState


async def openai_view(services: Services, job: StreamState) -> View:
    """How an existing job looks in the OpenAI format (for ``/v1/jobs/{id}/events?format=openai``)."""
    # The worker that took the job wrote its model's name; a queued job gets the served one's.
    model = job.model or min(await served_models(services.store), default="")
    return View.of(job.job_id, job.created_at, job.request, model)


async def stream_body(services: Services, view: View, job_id: str) -> AsyncGenerator[list[ServerSentEvent], None]:
    """The events of a streamed completion: every chunk of the job from the first."""
    async with services.watchers.watch(job_id):
        with services.hub.watch(job_id) as inbox:  # subscribed before relay() reads the log
            async for batch in relay(
                services.store, inbox, job_id, 0, services.settings.sse_ping_s, view.render
            ):
                yield batch
