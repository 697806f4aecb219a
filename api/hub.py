"""One Redis pub/sub connection per API process, fanned out to every open SSE stream.

The hub subscribes to the channel of each job that a stream of this process watches, and
routes each message to the in-process queues of those streams. It subscribes to nothing else:
an API process pays for the events of its own streams only, however many workers and replicas
share the Redis (a pattern subscription to every job's channel cost each replica about 17 us of
CPU per event of the whole cluster, docs/benchmarks.md).

A stream only needs the hub to be *fast*: the job log in Redis is the truth, so whenever the
hub may have missed messages (its connection dropped, or a slow stream's queue overflowed) it
puts ``RESYNC`` in the affected queues and those streams re-read the log from their cursor.

The contract: docs/internals.md#api-process-api.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.keys import Keys
from common.schemas.events import LogEntry
from common.tasks import cancel_until_done

log = logging.getLogger(__name__)


class _Resync:
    def __repr__(self) -> str:
        return "RESYNC"


class _Ping:
    def __repr__(self) -> str:
        return "PING"


RESYNC: Final = _Resync()
PING: Final = _Ping()  # put by a stream's own keep-alive timer (api/sse.py), never by the hub
Item = LogEntry | _Resync | _Ping
Inbox = asyncio.Queue[Item]

INBOX_SIZE = 1024  # per stream; past this the stream is told to re-read the log instead
# A stream waits this long at most for its job's subscription to be confirmed, then goes on: a
# connection that answers nothing (half-open) costs its streams latency (they re-read the log
# at each keep-alive), not a stream that never starts.
SUBSCRIBE_WAIT_S = 5.0
RECONNECT_DELAY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # back-off between reconnect attempts


async def _replies(pubsub: PubSub) -> AsyncIterator[tuple[str, bytes, bytes]]:
    """(kind, channel, data) of each reply on a connected pub/sub connection, as ``listen()``
    gives them.

    NOTE: a message is read straight off the connection, as redis-py's own ``listen()`` reads it
    but without the layers it adds per message (a health check, a retry wrapper that reconnects
    by itself, OpenTelemetry records, the message as a dict): about a sixth of the API's CPU per
    relayed token (docs/benchmarks.md). A dropped connection raises here instead, and the hub's
    reconnection subscribes every watched job again and sends RESYNC. Every other reply
    (confirmations) still goes through ``handle_message``, which keeps redis-py's record of the
    subscribed channels.
    """
    conn = pubsub.connection
    assert conn is not None  # (connected by the caller)
    while True:
        reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False, push_request=True)
        if isinstance(reply, list) and reply[0] == b"message":
            yield "message", reply[1], reply[2]
            continue
        message = await pubsub.handle_message(reply)
        if message is not None:
            yield _text(message["type"]), message["channel"], message["data"]


async def _as_is(message: list[object]) -> list[object]:
    # NOTE: redis-py 8.1's own handler formats every message into a debug line whether or not
    # debug logging is on (redis/redis-py#4230, fixed in #4231, not yet released): about a third
    # of the hub's CPU per message. This one hands the message on as it is.
    return message


@dataclass
class _Job:
    """The streams of this process that watch one job."""

    inboxes: set[Inbox] = field(default_factory=set)
    # Done once the job's channel is subscribed (or the connection it was asked on is gone: the
    # reconnection subscribes it again and sends RESYNC).
    subscribed: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Hub:
    def __init__(self, redis_url: str, keys: Keys, client_name: str) -> None:
        # Its own client, so the subscription's connection is never shared with commands, and
        # named so an operator (or a test) can find it in CLIENT LIST.
        self._redis = Redis.from_url(redis_url, client_name=client_name)
        self._keys = keys
        # Always subscribed: it keeps the connection listening when no job is watched, and its
        # confirmation after a (re)connection says every job channel asked with it is in place.
        self._own_channel = keys.hub_channel(client_name)
        self._jobs: dict[str, _Job] = {}
        self._by_channel: dict[bytes, _Job] = {}  # the same jobs by their channel, as messages name it
        self._pubsub: PubSub | None = None  # the current connection's, from its first SUBSCRIBE on
        # Per channel, the subscriptions asked on this connection and not yet confirmed, oldest
        # first: Redis confirms a connection's SUBSCRIBEs in the order they were sent.
        self._unconfirmed: dict[str, deque[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0  # connections made after the first, for /metrics

    @property
    def open_streams(self) -> int:
        return sum(len(job.inboxes) for job in self._jobs.values())

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="spool-hub")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_until_done([self._task])
        await self._redis.aclose()

    @contextlib.asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[Inbox]:
        """An inbox that receives the job's live events from now on (or RESYNC): entered once
        the job's channel is subscribed, so that anything read from the log after it is no older
        than what will come live."""
        inbox: Inbox = asyncio.Queue(INBOX_SIZE)
        job = self._jobs.get(job_id)
        first = job is None
        if job is None:
            job = self._jobs[job_id] = self._by_channel[self._keys.job_events(job_id).encode()] = _Job()
        job.inboxes.add(inbox)
        try:
            if first:
                await self._send(job, "subscribe", job_id)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                    await asyncio.shield(job.subscribed)  # (shared with the job's other streams)
            yield inbox
        finally:
            job.inboxes.discard(inbox)
            if not job.inboxes and self._jobs.get(job_id) is job:
                del self._jobs[job_id]
                del self._by_channel[self._keys.job_events(job_id).encode()]
                await self._send(job, "unsubscribe", job_id)

    async def _send(self, job: _Job, command: str, job_id: str) -> None:
        # NOTE: the command is written before this first yields to the loop, so commands reach
        # Redis in the order they were asked, however the streams interleave (an UNSUBSCRIBE by
        # one stream's end, then a SUBSCRIBE by a new stream of the same job, stays subscribed).
        pubsub, channel = self._pubsub, self._keys.job_events(job_id)
        if pubsub is None:  # not connected: the connection, once made, subscribes every watched job
            _settle(job.subscribed)
            return
        if command == "subscribe":
            self._unconfirmed.setdefault(channel, deque()).append(job.subscribed)
        try:
            await getattr(pubsub, command)(channel)
        except Exception as e:  # noqa: BLE001 (redis-py 8.1 raises AttributeError on a connection it just dropped)
            # The connection is gone or going: the hub's own read fails too, and its reconnection
            # subscribes every watched job and sends RESYNC. The stream goes on meanwhile.
            log.info("event hub could not %s %s (%r)", command, channel, e)
            _settle(job.subscribed)

    async def _run(self) -> None:
        failures = 0
        first = True
        while True:
            pubsub = self._redis.pubsub(push_handler_func=_as_is)
            try:
                await pubsub.connect()
                # From here on a new stream subscribes its job itself (after this, in order).
                self._pubsub = pubsub
                # Every job watched now, and last the hub's own channel: once that is confirmed,
                # so are the others, and anything published from then on reaches us.
                channels = [self._keys.job_events(job_id) for job_id in self._jobs]
                await pubsub.subscribe(*channels, self._own_channel)
                async for kind, raw_channel, data in _replies(pubsub):
                    if kind == "message":
                        self._route(raw_channel, data)
                    elif kind == "subscribe":
                        channel = _text(raw_channel)
                        if channel == self._own_channel:
                            self.reconnects += not first
                            first, failures = False, 0
                            self.connected.set()
                            # Anything published while we were not subscribed is only in the logs.
                            self._broadcast_resync()
                        elif pending := self._unconfirmed.get(channel):
                            _settle(pending.popleft())
                            if not pending:
                                del self._unconfirmed[channel]
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                self._disconnected()
                delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
                failures += 1
                log.warning("event hub lost Redis (%s); reconnecting in %.1fs", e, delay)
                await asyncio.sleep(delay)
            finally:
                self._disconnected()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _disconnected(self) -> None:
        self.connected.clear()
        self._pubsub = None  # (new streams subscribe with the next connection's first SUBSCRIBE)
        # Streams waiting for a subscription go on: they get RESYNC once reconnected.
        for pending in self._unconfirmed.values():
            for future in pending:
                _settle(future)
        self._unconfirmed.clear()

    def _route(self, channel: bytes, data: bytes) -> None:
        job = self._by_channel.get(channel)
        if job is None:  # (a message that was on its way when the last stream left)
            return
        item: Item
        try:
            item = LogEntry.decode(data)
        except ValidationError:
            # Whatever was published, the log holds the real event: let the streams re-read it.
            log.warning("malformed event on %s: %.200r", _text(channel), data)
            item = RESYNC
        for inbox in job.inboxes:
            self._put(inbox, item)

    def _broadcast_resync(self) -> None:
        for job in self._jobs.values():
            for inbox in job.inboxes:
                self._put(inbox, RESYNC)

    @staticmethod
    def _put(inbox: Inbox, item: Item) -> None:
        try:
            inbox.put_nowait(item)
        except asyncio.QueueFull:
            # A stream this far behind re-reads the log; what was queued is in there too.
            while not inbox.empty():
                inbox.get_nowait()
            inbox.put_nowait(RESYNC)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _text(channel: bytes | str) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel
