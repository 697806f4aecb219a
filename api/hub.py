"""One Redis pub/sub connection per API process, fanned out to every open SSE stream.

The hub holds a pattern subscription to every job's channel and routes each message to the
in-process queues of the streams watching that job. A stream only needs the hub to be *fast*:
the job log in Redis is the truth, so whenever the hub may have missed messages (its
connection dropped, or a slow stream's queue overflowed) it puts ``RESYNC`` in the affected
queues and those streams re-read the log from their cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Final

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.keys import Keys
from common.schemas import LogEntry

log = logging.getLogger(__name__)


class _Resync:
    def __repr__(self) -> str:
        return "RESYNC"


RESYNC: Final = _Resync()
Item = LogEntry | _Resync
Inbox = asyncio.Queue[Item]

INBOX_SIZE = 1024  # per stream; past this the stream is told to re-read the log instead
RECONNECT_DELAY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # back-off between reconnect attempts


async def _as_is(message: list[object]) -> list[object]:
    # NOTE: redis-py 8.1's own handler formats every message into a debug line whether or not
    # debug logging is on (redis/redis-py#4230, fixed in #4231, not yet released): about a third
    # of the hub's CPU per message. This one hands the message on as it is.
    return message


class Hub:
    def __init__(self, redis_url: str, keys: Keys, client_name: str) -> None:
        # Its own client, so the subscription's connection is never shared with commands, and
        # named so an operator (or a test) can find it in CLIENT LIST.
        self._redis = Redis.from_url(redis_url, client_name=client_name)
        self._keys = keys
        self._inboxes: dict[str, set[Inbox]] = {}
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0  # connections made after the first, for /metrics

    @property
    def open_streams(self) -> int:
        return sum(len(s) for s in self._inboxes.values())

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="spool-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()

    @contextlib.contextmanager
    def watch(self, job_id: str) -> Iterator[Inbox]:
        """An inbox that receives the job's live events from now on (or RESYNC)."""
        inbox: Inbox = asyncio.Queue(INBOX_SIZE)
        self._inboxes.setdefault(job_id, set()).add(inbox)
        try:
            yield inbox
        finally:
            watchers = self._inboxes[job_id]
            watchers.discard(inbox)
            if not watchers:
                del self._inboxes[job_id]

    async def _run(self) -> None:
        failures = 0
        first = True
        while True:
            pubsub = self._redis.pubsub(push_handler_func=_as_is)
            try:
                await pubsub.psubscribe(self._keys.job_events_pattern())
                # psubscribe returns before the server confirms; only after the confirmation
                # are messages guaranteed to reach us, so wait for it before declaring the hub live.
                while await pubsub.get_message(timeout=1.0) is None:
                    pass
                self.reconnects += not first
                first, failures = False, 0
                self.connected.set()
                # Anything published while we were not subscribed is only in the logs.
                self._broadcast_resync()
                async for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        self._route(message["channel"], message["data"])
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                self.connected.clear()
                delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
                failures += 1
                log.warning("event hub lost Redis (%s); reconnecting in %.1fs", e, delay)
                await asyncio.sleep(delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _route(self, channel: bytes | str, data: bytes | str) -> None:
        channel = channel.decode() if isinstance(channel, bytes) else channel
        watchers = self._inboxes.get(self._keys.job_id_from_channel(channel))
        if not watchers:
            return
        item: Item
        try:
            item = LogEntry.decode(data)
        except ValidationError:
            # Whatever was published, the log holds the real event: let the streams re-read it.
            log.warning("malformed event on %s: %.200r", channel, data)
            item = RESYNC
        for inbox in watchers:
            self._put(inbox, item)

    def _broadcast_resync(self) -> None:
        for watchers in self._inboxes.values():
            for inbox in watchers:
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
