"""The relay behind ``GET /v1/jobs/{id}/events``: stored log first, then live events.

Correctness does not depend on timing: the stream subscribes (via the hub) before it reads
the log, so every event is either in what it read or still to come live; it drops live events
it has already sent, and when a live event skips ahead of its cursor (or the hub says it may
have missed some) it re-reads the log from the cursor. No gap, no duplicate.

The relay's steps: docs/internals.md#api-process-api, and docs/internals.md#the-path-of-one-token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi.sse import EventSourceResponse, ServerSentEvent, format_sse_event
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.background import BackgroundTask

from api.errors import error_body
from api.hub import PING, Inbox, Item
from common.schemas.events import LogEntry
from common.store import AsyncJobStore

# An event to send. The relay (pings, errors) or a view (OpenAI chunks) builds it, or it is
# already in the wire format (a job's own events, from ``job_event``).
Chunk = ServerSentEvent | bytes
Render = Callable[[LogEntry], Sequence[Chunk]]  # a log entry as the events a client gets
T = TypeVar("T")


@dataclass(frozen=True)
class AsyncRender:
    """A view whose events need reads of their own (the Images API's completed event carries its
    image): a batch of entries (and the relay's own events, passed on) in, the chunks out."""

    render: Callable[[Sequence[LogEntry | ServerSentEvent]], Awaitable[list[Chunk]]]


# As FastAPI's own SSE responses: no caching, and no buffering by a proxy (nginx) in between.
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

REDIS_PATIENCE_S = 30.0  # how long an open stream waits for Redis to come back
REDIS_RETRY_S = 0.5


def backend_unavailable_event(e: Exception) -> ServerSentEvent:
    """The end of a stream cut short by Redis (not a job event: no id; resume with Last-Event-ID)."""
    message = f"Redis is unreachable ({e}); resume the stream with Last-Event-ID"
    return ServerSentEvent(event="error", data=error_body(503, message, code="backend_unavailable"))


def encode(event: Chunk) -> bytes:
    """One event in the SSE wire format (FastAPI's encoder); ``data`` must be JSON-native."""
    if isinstance(event, bytes):
        return event
    if event.comment is not None and event.data is event.raw_data is event.event is event.id is None:
        # NOTE: a comment line alone, with no blank line after it: a decoder that keeps the last
        # event id (the openai SDK's, as the SSE spec says) dispatches an event at every blank
        # line after one, and a ping then reached its stream as an event with empty data.
        return f": {event.comment}\n".encode()
    data = event.raw_data if event.data is None else json.dumps(event.data)
    return format_sse_event(
        data_str=data, event=event.event, id=event.id, retry=event.retry, comment=event.comment
    )


def event_stream(
    events: AsyncGenerator[list[Chunk], None], headers: Mapping[str, str] | None = None
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

    return EventSourceResponse(
        chunks, headers={**NO_BUFFERING, **(headers or {})}, background=BackgroundTask(close)
    )


def to_sse_list(entry: LogEntry) -> list[Chunk]:
    return [job_event(entry)]


def job_event(entry: LogEntry) -> bytes:
    """A job event in the SSE wire format, byte for byte what ``encode`` makes of
    ``ServerSentEvent(id=seq, event=type, data=data)``.

    NOTE: formatted here rather than through a ServerSentEvent (a pydantic model) and FastAPI's
    encoder: that was about a fifth of the API's CPU per relayed token (docs/benchmarks.md).
    One ``data:`` line is enough: ``json.dumps`` escapes every newline.
    """
    data = entry.data
    if entry.type == "token":
        # token_ids stay internal; the HTTP contract streams text (and a part's index, and in a
        # job with n > 1 the choice, with its finish_reason on its last event; and a scored
        # prompt's logprobs and tokens on its choice's first event).
        shown = {"index": data["index"], "text": data["text"]}
        if "choice" in data:
            shown["choice"] = data["choice"]
            if "finish_reason" in data:
                shown["finish_reason"] = data["finish_reason"]
        if "prompt_logprobs" in data:
            shown["prompt_logprobs"] = data["prompt_logprobs"]
            shown["prompt_tokens"] = data.get("prompt_tokens")
        data = shown if "part" not in data else {"part": data["part"], **shown}
    return b"event: %s\ndata: %s\nid: %d\n\n" % (entry.type.encode(), json.dumps(data).encode(), entry.seq)


class KeepAlive:
    """Puts PING in a stream's inbox once it has waited ``ping_s`` for an event.

    NOTE: one timer per stream, moved on lazily: ``waiting()`` only notes the time, and the
    timer, when it fires early, sets itself again for the time left. An ``asyncio.timeout``
    around each wait (a timer armed and cancelled per event) cost about a tenth of the API's CPU
    per relayed token (docs/benchmarks.md).
    """

    def __init__(self, inbox: Inbox, ping_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox = inbox
        self._ping_s = ping_s
        self._since = self._loop.time()
        self._timer = self._loop.call_at(self._since + ping_s, self._fire)

    def waiting(self) -> None:
        """The stream starts waiting for its next event now."""
        self._since = self._loop.time()

    def close(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        due = self._since + self._ping_s
        if self._loop.time() >= due:
            if self._inbox.empty():  # (else the stream has something to do already)
                self._inbox.put_nowait(PING)
            due = self._loop.time() + self._ping_s
        self._timer = self._loop.call_at(due, self._fire)


async def relay(
    store: AsyncJobStore,
    inbox: Inbox,
    job_id: str,
    after: int,
    ping_s: float,
    render: Callable[[LogEntry], Sequence[T]],
) -> AsyncGenerator[list[T | ServerSentEvent], None]:
    """Yield the job's events with seq > ``after`` (each as ``render`` makes it), then close after
    the terminal one.

    Events come in batches of what is at hand: the log read, or every live event already waiting
    in the inbox. A stream that fell behind (a busy API process) thus catches up in fewer, larger
    writes instead of one per event. ``inbox`` must already watch the job (``Hub.watch``):
    subscribed before the first read.
    """
    keepalive = KeepAlive(inbox, ping_s)
    try:
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
            batch: list[T | ServerSentEvent] = []
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
                keepalive.waiting()
                item: Item | None = await inbox.get()
                if item is PING:
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
    finally:
        keepalive.close()


def _as_is(entry: LogEntry) -> tuple[LogEntry]:
    return (entry,)


def rendered(
    store: AsyncJobStore, inbox: Inbox, job_id: str, after: int, ping_s: float, render: Render | AsyncRender
) -> AsyncGenerator[list[Chunk], None]:
    """``relay`` through either kind of view (a plain one straight: no generator in between)."""
    if isinstance(render, AsyncRender):
        return _expanded(relay(store, inbox, job_id, after, ping_s, _as_is), render)
    return relay(store, inbox, job_id, after, ping_s, render)


async def _expanded(
    entries: AsyncGenerator[list[LogEntry | ServerSentEvent], None], render: AsyncRender
) -> AsyncGenerator[list[Chunk], None]:
    async with aclosing(entries):
        async for items in entries:
            if chunks := await render.render(items):
                yield chunks
