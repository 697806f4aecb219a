"""Submitting a job and answering for it, on either API: store it with its message, wait for it to
end, or stream its events from the first.

A foreground job (``background: false``, and every OpenAI request unless it says otherwise) is
watched by the request that submitted it; a client that hangs up stops watching at once, so a
foreground job nobody else watches is cancelled after ``SPOOL_DETACH_GRACE_S`` (api/watchers.py).

The path of a submitted job: docs/internals.md#the-path-of-one-token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing

from fastapi import Request
from fastapi.sse import EventSourceResponse

from api.auth import check_priority, current_owner
from api.enqueue import message_priority
from api.errors import ApiError
from api.services import Services
from api.sse import AsyncRender, Chunk, Render, event_stream, relay, rendered
from common.asyncio_tasks import cancel_until_done
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job
from common.store import IdempotencyConflict, QueueFull
from common.store.hooks import AsyncHookStore
from common.tenants import tenant_of
from common.webhooks import BadDestination, check_destination

RETRY_AFTER_S = 2  # a full queue drains at the workers' pace; retrying sooner only adds load
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it; logged, never received


async def submit_job(
    services: Services, body: JobRequest, model: str, idempotency_key: str | None = None
) -> Job:
    """Store the job with its Celery message to ``model``'s queue, in one script (429 when the
    queue is full; 403 for a priority its key may not give)."""
    metrics = services.metrics
    if body.webhook is not None:
        await check_webhook(services, body.webhook)
    owner, settings = current_owner(), services.settings
    check_priority(settings, owner, body.priority)
    queue, priority, tenant = settings.keys.model_queue(model), message_priority(body), tenant_of(owner)
    body.with_endpoints(await AsyncHookStore(services.store.redis, settings).endpoints(owner))
    try:
        job = await services.store.create_job(
            body,
            owner,
            lambda job_id: services.enqueuer.generate(job_id, queue, priority, tenant),
            idempotency_key,
            services.enqueuer.media,
        )
    except QueueFull as e:  # counted with the other refusals (api/metrics.py)
        raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except IdempotencyConflict as e:
        raise ApiError(409, str(e), param="Idempotency-Key", code="idempotency_key_reused") from None
    metrics.jobs_submitted.inc()
    return job


async def check_webhook(services: Services, url: str) -> None:
    """400 for a webhook URL whose host does not resolve, or resolves to an address refused
    (loopback, private, link-local, multicast) without SPOOL_WEBHOOK_ALLOW_PRIVATE."""
    settings = services.settings
    try:
        await check_destination(url, settings.webhook_allow_private, settings.webhook_allow_host_set)
    except BadDestination as e:
        raise ApiError(400, str(e), param="webhook", code="invalid_webhook") from None


async def wait_for_job(services: Services, job_id: str, request: Request) -> Job:
    """The job once it is final; the caller counts as a watcher meanwhile."""

    async def hung_up() -> None:
        # The body was read, so the next ASGI message is the disconnect (or nothing).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async with services.watchers.watch(job_id):
        waits = [asyncio.ensure_future(until_final(services, job_id)), asyncio.ensure_future(hung_up())]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_until_done(waits)
            await asyncio.gather(*waits, return_exceptions=True)  # their ends, errors included, seen
        if waits[0] not in done:
            raise ApiError(
                CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed_request"
            )
        waits[0].result()  # relay's errors (Redis unreachable) go to their handlers
    return await services.store.get_job(job_id)


def _nothing(entry: LogEntry) -> tuple[()]:
    return ()


async def until_final(services: Services, job_id: str) -> None:
    """Return once the job is final (its log holds the terminal event)."""
    # relay() ends after the terminal event whatever the timing, so the job is then final.
    async with services.follow(job_id, watch=False) as inbox:
        async for _ in relay(services.store, inbox, job_id, 0, services.settings.sse_ping_s, _nothing):
            pass


def streamed_submit(
    services: Services,
    job_id: str,
    render: Render | AsyncRender,
    foreground: bool,
    headers: Mapping[str, str],
    prelude: Sequence[Chunk] = (),
) -> EventSourceResponse:
    """The answer to a streamed submit: every event of the job from the first (after ``prelude``). A foreground job's
    client counts as its watcher while it reads (closed with the response, so a client that hangs
    up stops watching at once)."""
    if foreground:
        services.watchers.check_later(job_id)  # a client that leaves before the first byte
    return followed_stream(services, job_id, render, 0, foreground, headers, prelude)


def followed_stream(
    services: Services,
    job_id: str,
    render: Render | AsyncRender,
    after: int,
    watch: bool,
    headers: Mapping[str, str] | None = None,
    prelude: Sequence[Chunk] = (),
) -> EventSourceResponse:
    """The job's events after seq ``after``, first ``prelude`` (a view's own opening events);
    with ``watch`` the client counts as the job's watcher while it reads."""

    async def events() -> AsyncGenerator[list[Chunk], None]:
        async with services.follow(job_id, watch=watch) as inbox:
            if prelude:
                yield list(prelude)
            events = rendered(services.store, inbox, job_id, after, services.settings.sse_ping_s, render)
            async with aclosing(events):
                async for batch in events:
                    yield batch

    return event_stream(events(), headers)
