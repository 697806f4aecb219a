"""The event hub's connections (api/hub.py): one pub/sub connection, to the standalone Redis or to
one master of a Redis Cluster, that subscribes the channels of its jobs, reads their messages
and hands them to the hub, and reconnects (with a new slot map on a cluster) when it drops or a
slot leaves its node.

The two modules are one: each uses the other's private names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter, deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.buckets import key_slot

if TYPE_CHECKING:
    from api.hub import Hub, _Job

log = logging.getLogger("api.hub")  # (the hub's own log, as before the split)

Address = tuple[str, int]  # a cluster node's (host, port), as CLUSTER SLOTS names it

RECONNECT_DELAY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # back-off between reconnect attempts
# Cluster only: a connection's first start takes a slot map this young as it is (the hub's first
# map starts every connection at once). Were it stale, the SSUBSCRIBE on a node that no longer
# owns the slot is answered MOVED, and that connection starts over with a new map.
SLOTS_MAX_AGE_S = 0.1


class _SlotMoved(Exception):
    """The server dropped a connection's own channel: its slot left that node."""


async def _replies(pubsub: PubSub) -> AsyncIterator[tuple[str, bytes, bytes]]:
    """(kind, channel, data) of each reply on a connected pub/sub connection, as ``listen()``
    gives them.

    NOTE: a message is read straight off the connection, as redis-py's own ``listen()`` reads it
    but without the layers it adds per message (a health check, a retry wrapper that reconnects
    by itself, OpenTelemetry records, the message as a dict): about a sixth of the API's CPU per
    relayed token (docs/benchmarks.md). A dropped connection raises here instead, and so does an
    error reply (MOVED: a subscription sent to a node that no longer owns the channel's slot);
    the hub's reconnection then subscribes that connection's jobs again and sends RESYNC. Every
    other reply (confirmations) still goes through ``handle_message``, which keeps redis-py's
    record of the subscribed channels.
    """
    conn = pubsub.connection
    assert conn is not None  # (connected by the caller)
    while True:
        reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False, push_request=True)
        if isinstance(reply, list) and reply[0] == b"smessage":
            yield "smessage", reply[1], reply[2]
            continue
        message = await pubsub.handle_message(reply)
        if message is not None:
            yield _text(message["type"]), message["channel"], message["data"]


async def _as_is(message: list[object]) -> list[object]:
    # NOTE: redis-py 8.1's own handler formats every message into a debug line whether or not
    # debug logging is on (redis/redis-py#4230, fixed in #4231, not yet released): about a third
    # of the hub's CPU per message. This one hands the message on as it is.
    return message


class _Link:
    """One pub/sub connection: to the standalone Redis (``address`` None), or to one master of a
    cluster, for the jobs whose channel's slot it owns."""

    def __init__(self, hub: Hub, address: Address | None) -> None:
        self.hub, self.address = hub, address
        self.where = "Redis" if address is None else f"Redis node {address[0]}:{address[1]}"  # (for logs)
        # Its own client, so the subscription's connection is never shared with commands.
        self.redis = hub.client(address, hub._client_name)
        self.jobs: set[_Job] = set()
        # Always subscribed: it keeps the connection listening when no job is watched, and its
        # confirmation after a (re)connection says every job channel asked with it is in place.
        self.own_channel = hub.own_channel(None) if address is None else ""
        self.pubsub: PubSub | None = None  # the current connection's, from its first SSUBSCRIBE on
        # Per channel, the subscriptions asked on this connection and not yet confirmed, oldest
        # first (Redis confirms a connection's SSUBSCRIBEs in the order they were sent), each
        # with whether its streams get RESYNC once it is.
        self.unconfirmed: dict[str, deque[tuple[_Job, bool]]] = {}
        # Per channel, the SUNSUBSCRIBEs sent and not yet answered: an answer beyond them is the
        # server's own, for a channel whose slot left this node.
        self.unsubscribing: Counter[str] = Counter()
        self.connected = False
        self.first = True
        self.task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        await self.redis.aclose()
        if self.address is not None:
            await self.redis.connection_pool.disconnect()

    async def send(self, job: _Job, command: str, resync: bool = False) -> None:
        # NOTE: the command is written before this first yields to the loop, so commands reach
        # Redis in the order they were asked, however the streams interleave (an SUNSUBSCRIBE by
        # one stream's end, then an SSUBSCRIBE by a new stream of the same job, stays subscribed).
        pubsub, channel = self.pubsub, job.channel
        if pubsub is None:  # not connected: the connection, once made, subscribes every job of it
            _settle(job.subscribed)
            return
        if command == "ssubscribe":
            self.unconfirmed.setdefault(channel, deque()).append((job, resync))
        else:
            self.unsubscribing[channel] += 1
        try:
            await getattr(pubsub, command)(channel)
        except Exception as e:  # noqa: BLE001 (redis-py 8.1 raises AttributeError on a connection it just dropped)
            # The connection is gone or going: the hub's own read fails too, and its reconnection
            # subscribes every job of it and sends RESYNC. The stream goes on meanwhile.
            log.info("event hub could not %s %s (%r)", command, channel, e)
            _settle(job.subscribed)

    async def run(self) -> None:
        hub = self.hub
        failures = 0
        while True:
            pubsub = self.redis.pubsub(push_handler_func=_as_is)
            try:
                if self.address is not None:
                    # Where each slot is now: this node's jobs whose slot left it go to the new
                    # owner; a node that owns no slot any more hands them all over and ends.
                    # (A first connection takes the map that made it, unless that map is old.)
                    await hub.refresh(self.address, SLOTS_MAX_AGE_S if self.first else 0.0)
                    if self.address not in hub._masters():
                        log.info("event hub: %s owns no slot any more", self.where)
                        await hub.retire(self)
                        await self.close()
                        return
                    await hub._move([job for job in self.jobs if hub._link_for(job.channel) is not self])
                    self.own_channel = hub.own_channel(self.address)
                await pubsub.connect()
                # From here on a new stream subscribes its job itself (after this, in order).
                self.pubsub = pubsub
                await self._subscribe_all(pubsub)
                async for kind, raw_channel, data in _replies(pubsub):
                    if kind == "smessage":
                        hub.route(raw_channel, data)
                    elif kind == "ssubscribe":
                        if self._confirmed(_text(raw_channel)):
                            failures = 0
                    elif kind == "sunsubscribe":
                        await self._unsubscribed(_text(raw_channel))
            except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError, _SlotMoved) as e:
                self._disconnected()
                delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
                failures += 1
                log.warning("event hub lost %s (%r); reconnecting in %.1fs", self.where, e, delay)
                await asyncio.sleep(delay)
            finally:
                self._disconnected()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _subscribe_all(self, pubsub: PubSub) -> None:
        """Every job of this connection, and last its own channel: once that is confirmed, so are
        the others, and anything published from then on reaches us."""
        groups: dict[int, list[_Job]] = {}
        for job in self.jobs:
            # On a cluster one SSUBSCRIBE may name the channels of one slot only.
            groups.setdefault(key_slot(job.channel) if self.address else 0, []).append(job)
        for jobs in groups.values():
            for job in jobs:
                self.unconfirmed.setdefault(job.channel, deque()).append((job, False))
            await pubsub.ssubscribe(*(job.channel for job in jobs))
        await pubsub.ssubscribe(self.own_channel)

    def _confirmed(self, channel: str) -> bool:
        """Handle an SSUBSCRIBE's confirmation; True for the connection's own channel."""
        if channel == self.own_channel:
            self.hub.reconnects += not self.first
            self.first, self.connected = False, True
            self.hub.update_connected()
            # Anything published while we were not subscribed is only in the logs.
            self.hub.resync(self.jobs)
            return True
        if pending := self.unconfirmed.get(channel):
            job, resync = pending.popleft()
            if not pending:
                del self.unconfirmed[channel]
            _settle(job.subscribed)
            if resync:  # (moved here from another node's connection)
                self.hub.resync([job])
        return False

    async def _unsubscribed(self, channel: str) -> None:
        if self.unsubscribing[channel] > 0:
            self.unsubscribing[channel] -= 1
            if not self.unsubscribing[channel]:
                del self.unsubscribing[channel]
            return
        # Not an answer: the server dropped the channel, its slot left this node (resharding, or
        # a failover made this node a replica). Subscribe it where the slot went.
        if channel == self.own_channel:
            raise _SlotMoved(channel)
        job = self.hub.by_channel(channel)
        if job is None or job.link is not self:
            return
        log.info("event hub: %s left %s", channel, self.where)
        if self.hub._link_for(channel) is self:  # (else an earlier channel of the slot brought the new map)
            await self.hub.refresh(self.address)
        await self.hub._move([job])

    def _disconnected(self) -> None:
        self.connected = False
        self.hub.update_connected()
        self.pubsub = None  # (new streams subscribe with the next connection's first SSUBSCRIBE)
        # Streams waiting for a subscription go on: they get RESYNC once reconnected.
        for pending in self.unconfirmed.values():
            for job, _ in pending:
                _settle(job.subscribed)
        self.unconfirmed.clear()
        self.unsubscribing.clear()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _text(channel: bytes | str) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel
