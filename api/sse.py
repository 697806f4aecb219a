"""The relay behind ``GET /v1/jobs/{id}/events``: stored log first, then live events.

Correctness does not depend on timing: the stream subscribes (via the hub) before it reads
the log, so every event is either in what it read or still to come live; it drops live events
it has already sent, and when a live event skips ahead of its cursor (or the hub says it may
have missed some) it re-reads the log from the cursor. No gap, no duplicate.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing

from fastapi.sse import EventSourceResponse, ServerSentEvent, format_sse_event
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.background import BackgroundTask

from api.errors import error_body
from api.hub import Inbox, Item
from common.schemas import LogEntry
from common.store import AsyncJobStore

Render = Callable[[LogEntry], list[ServerSentEvent]]  # a log entry as the events a client gets

# As FastAPI's own SSE responses: no caching, and no buffering by a proxy (nginx) in between.
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

REDIS_PATIENCE_S = 30.0  # how long an open stream waits for Redis to come back
REDIS_RETRY_S = 0.5


def backend_unavailable_event(e: Exception) -> ServerSentEvent:
    """The end of a stream cut short by Redis (not a job event: no id; resume with Last-Event-ID)."""
    message = f"Redis is unreachable ({e}); resume the stream with Last-Event-ID"
    return ServerSentEvent(event="error", data=error_body(503, message, code="backend_unavailable"))


def encode(event: ServerSentEvent) -> bytes:
    """One event in the SSE wire format (FastAPI's encoder); ``data`` must be JSON-native."""
    data = event.raw_data if event.data is None else json.dumps(event.data)
    return format_sse_event(data_str=data, event=event.event, id=event.id, retry=event.retry, comment=event.comment)


def event_stream(
    events: AsyncGenerator[list[ServerSentEvent], None], headers: Mapping[str, str] | None = None
) -> EventSourceResponse:
    """A response that streams ``events``, each batch in one write (closed when the response
    ends, hang-up included).

    NOTE: not a ``yield`` endpoint with ``response_class=EventSourceResponse``: FastAPI runs those
    through a producer task, a keep-alive task and two memory streams, which cost 0.08 ms of CPU
    per event, 60% of the API's whole cost of relaying a token (docs/benchmarks.md). relay()
    sends its own keep-alive pings.
    """

    async def body() -> AsyncGenerator[bytes, None]:
        async with aclosing(events):
            async for batch in events:
                yield b"".join(map(encode, batch))

    chunks = body()

    # A client that hangs up leaves the body suspended at a yield until the garbage collector
    # finalizes it; the background task (it runs after a disconnect too) closes it at once.
    # NOTE: a coroutine function: Starlette runs anything else, ``chunks.aclose`` itself
    # included, in its thread pool, where the awaitable it returns is dropped unawaited.
    async def close() -> None:
        await chunks.aclose()

    return EventSourceResponse(chunks, headers={**NO_BUFFERING, **(headers or {})}, background=BackgroundTask(close))


def to_sse_list(entry: LogEntry) -> list[ServerSentEvent]:
    return [to_sse(entry)]


def to_sse(entry: LogEntry) -> ServerSentEvent:
    data = entry.data
    if entry.type == "token":
        # token_ids stay internal; the HTTP contract streams text (and a part's index).
        shown = {"index": data["index"], "text": data["text"]}
        data = shown if "part" not in data else {"part": data["part"], **shown}
    return ServerSentEvent(id=str(entry.seq), event=entry.type, data=data)


async def relay(
    store: AsyncJobStore,
    inbox: Inbox,
    job_id: str,
    after: int,
    ping_s: float,
    render: Render = to_sse_list,
) -> AsyncGenerator[list[ServerSentEvent], None]:
    """Yield the job's events with seq > ``after``, then close after the terminal one.

    Events come in batches of what is at hand: the log read, or every live event already waiting
    in the inbox. A stream that fell behind (a busy API process) thus catches up in fewer, larger
    writes instead of one per event. ``inbox`` must already watch the job (``Hub.watch``):
    subscribed before the first read.
    """
    last = after
    outage: float | None = None  # loop time Redis was first found unreachable
    while True:
        # Read from the cursor's own entry, not the next one: if the client resumes right
        # after the terminal event, that entry is how we know to close at once.
        try:
            entries = await store.read_log(job_id, after=max(last - 1, 0))
        except (RedisConnectionError, RedisTimeoutError) as e:
            # Redis restarting: keep the client's connection open and read again. Past the
            # patience, end with an error event that has no id, so Last-Event-ID (the last job
            # event sent) resumes exactly where this stream stopped.
            now = asyncio.get_running_loop().time()
            outage = outage or now
            if now - outage > REDIS_PATIENCE_S:
                yield [backend_unavailable_event(e)]
                return
            yield [ServerSentEvent(comment="redis unreachable; retrying")]
            await asyncio.sleep(REDIS_RETRY_S)
            continue
        outage = None
        batch: list[ServerSentEvent] = []
        ended = False
        for entry in entries:
            if entry.seq > last:
                batch += render(entry)
                last = entry.seq
            if ended := entry.terminal:
                break
        if batch:
            yield batch
        if ended:
            return
        while True:
            try:
                # (asyncio.timeout, not wait_for: no task of its own per event)
                async with asyncio.timeout(ping_s):
                    item: Item | None = await inbox.get()
            except TimeoutError:
                yield [ServerSentEvent(comment="ping")]
                # Idle: re-read the log too, so even a hub that silently stopped receiving
                # (a half-open connection) costs latency, never events.
                break
            batch, reread = [], False
            while item is not None:
                if not isinstance(item, LogEntry) or item.seq > last + 1:
                    reread = True  # RESYNC (the hub may have missed events), or one skips ahead
                    break
                if item.seq > last:  # (else already sent from the log)
                    batch += render(item)
                    last = item.seq
                    if item.terminal:
                        yield batch
                        return
                item = inbox.get_nowait() if not inbox.empty() else None
            if batch:
                yield batch
            if reread:
                break
