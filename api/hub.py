"""One Redis pub/sub connection per API process (per master node on a Redis Cluster), fanned out
to every open SSE stream.

The hub subscribes to the channel of each job that a stream of this process watches, and
routes each message to the in-process queues of those streams. It subscribes to nothing else:
an API process pays for the events of its own streams only, however many workers and replicas
share the Redis (a pattern subscription to every job's channel cost each replica about 17 us of
CPU per event of the whole cluster, docs/benchmarks.md).

Job channels are shard channels (SSUBSCRIBE, and the store's scripts SPUBLISH): on a Redis
Cluster only the master that owns a channel's slot carries its messages, so the hub keeps one
connection per master and subscribes each channel on its slot's owner (the slot map from CLUSTER
SLOTS). On a standalone Redis the same code runs with one connection that takes every channel.

A stream only needs the hub to be *fast*: the job log in Redis is the truth, so whenever the
hub may have missed messages (a connection dropped, a channel's slot moved to another node, or
a slow stream's queue overflowed) it puts ``RESYNC`` in the affected queues and those streams
re-read the log from their cursor.

Each connection (``_Link``, below the hub) subscribes the channels of its jobs, reads their
messages and hands them to the hub, and reconnects (with a new slot map on a cluster) when it
drops or a slot leaves its node. The contract: docs/internals.md#api-process-api.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.asyncio_tasks import cancel_until_done
from common.buckets import CLUSTER_SLOTS, key_slot
from common.keys import Keys
from common.schemas.events import LogEntry

log = logging.getLogger(__name__)

Address = tuple[str, int]  # a cluster node's (host, port), as CLUSTER SLOTS names it

RECONNECT_DELAY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # back-off between reconnect attempts
# Cluster only: a connection's first start takes a slot map this young as it is (the hub's first
# map starts every connection at once). Were it stale, the SSUBSCRIBE on a node that no longer
# owns the slot is answered MOVED, and that connection starts over with a new map.
SLOTS_MAX_AGE_S = 0.1


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
SLOTS_TIMEOUT_S = 2.0  # connect and answer, per node asked for the slot map


@dataclass(eq=False)
class _JobStreams:
    """The streams of this process that watch one job."""

    channel: str
    inboxes: set[Inbox] = field(default_factory=set)
    # Done once the job's channel is subscribed (or the connection it was asked on is gone: the
    # reconnection subscribes it again and sends RESYNC).
    subscribed: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    link: _Link | None = None  # the connection it is subscribed on (None: no slot map yet)


class Hub:
    def __init__(self, redis_url: str, keys: Keys, client_name: str, *, cluster: bool = False) -> None:
        """``cluster``: ``redis_url`` names a node of a Redis Cluster (``cluster_enabled:1`` in
        INFO cluster, common/redis_policy.py); the hub then finds every master from it."""
        self._url = redis_url
        self._keys = keys
        # Each connection's client is named so an operator (or a test) can find it in CLIENT LIST.
        self._client_name = client_name
        self.cluster = cluster
        self._jobs: dict[str, _JobStreams] = {}
        self._by_channel: dict[bytes, _JobStreams] = {}  # the same jobs by their channel, as messages name it
        self._links: dict[Address | None, _Link] = {}  # by node; one, under None, on a standalone Redis
        # Cluster only: each slot's master (None until the first map), when the map was taken, and
        # the jobs watched before it came (they go to their node's connection once it does).
        self._slots: list[Address | None] = [None] * CLUSTER_SLOTS
        self._slots_at = -math.inf
        self._slots_lock = asyncio.Lock()
        self._unplaced: set[_JobStreams] = set()
        self._options: dict[str, Any] = dict(parse_url(redis_url)) if cluster else {}
        self._task: asyncio.Task[None] | None = None  # cluster: the first slot map's
        self.connected = asyncio.Event()  # set while every connection is subscribed
        self.reconnects = 0  # connections made after a connection's first, for /metrics

    @property
    def open_streams(self) -> int:
        return sum(len(job.inboxes) for job in self._jobs.values())

    async def start(self) -> None:
        if self.cluster:
            self._task = asyncio.create_task(self._first_map(), name="spool-hub-slots")
        else:
            self._add_link(None)

    async def stop(self) -> None:
        tasks = [link.task for link in self._links.values() if link.task is not None]
        await cancel_until_done([t for t in [self._task, *tasks] if t is not None])
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()

    @contextlib.asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[Inbox]:
        """An inbox that receives the job's live events from now on (or RESYNC): entered once
        the job's channel is subscribed, so that anything read from the log after it is no older
        than what will come live."""
        inbox: Inbox = asyncio.Queue(INBOX_SIZE)
        job = self._jobs.get(job_id)
        first = job is None
        if job is None:
            channel = self._keys.job_events(job_id)
            job = self._jobs[job_id] = self._by_channel[channel.encode()] = _JobStreams(channel)
        job.inboxes.add(inbox)
        try:
            if first:
                await self._place(job, resync=False)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                    await asyncio.shield(job.subscribed)  # (shared with the job's other streams)
            yield inbox
        finally:
            job.inboxes.discard(inbox)
            if not job.inboxes and self._jobs.get(job_id) is job:
                del self._jobs[job_id]
                del self._by_channel[job.channel.encode()]
                self._unplaced.discard(job)
                link, job.link = job.link, None
                if link is not None:
                    link.jobs.discard(job)
                    await link.send(job, "sunsubscribe")

    async def _place(self, job: _JobStreams, resync: bool) -> None:
        """Subscribe the job on the connection of its channel's node (RESYNC once confirmed if
        ``resync``: it may have missed messages while it moved)."""
        link = self._link_for(job.channel)
        job.link = link
        if link is None:  # (cluster, no slot map yet: the first map places it)
            self._unplaced.add(job)
            _settle(job.subscribed)
            return
        link.jobs.add(job)
        await link.send(job, "ssubscribe", resync)

    async def _move(self, jobs: Iterable[_JobStreams]) -> None:
        """Place these jobs again, by the current slot map, each with RESYNC once subscribed.
        Their old connection has lost them already (dropped, or the server unsubscribed them)."""
        for job in list(jobs):
            if self._by_channel.get(job.channel.encode()) is not job:
                continue  # (its last stream has left meanwhile)
            self._unplaced.discard(job)
            if job.link is not None:
                job.link.jobs.discard(job)
            await self._place(job, resync=True)

    def _link_for(self, channel: str) -> _Link | None:
        if not self.cluster:
            return self._links.get(None)
        address = self._slots[key_slot(channel)]
        if address is None:
            return None
        return self._links.get(address) or self._add_link(address)

    def _add_link(self, address: Address | None) -> _Link:
        link = self._links[address] = _Link(self, address)
        link.task = asyncio.create_task(link.run(), name=f"spool-hub-{address}")
        self.update_connected()
        return link

    def _masters(self) -> set[Address]:
        return {a for a in self._slots if a is not None}

    def update_connected(self) -> None:
        if self._links and all(link.connected for link in self._links.values()):
            self.connected.set()
        else:
            self.connected.clear()

    def client(self, address: Address | None, name: str | None) -> Redis:
        """A client of the standalone Redis (``address`` None) or of one cluster node, with the
        URL's other settings (credentials, TLS)."""
        if address is None:
            return Redis.from_url(self._url, client_name=name)
        host, port = address
        return Redis(
            connection_pool=ConnectionPool(
                **{**self._options, "host": host, "port": port, "client_name": name}
            )
        )

    async def _first_map(self) -> None:
        failures = 0
        while True:
            try:
                await self.refresh(None)
                return
            except (RedisError, OSError) as e:
                delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
                failures += 1
                log.warning("event hub found no cluster node (%s); asking again in %.1fs", e, delay)
                await asyncio.sleep(delay)

    async def refresh(self, prefer: Address | None, max_age_s: float = 0.0) -> None:
        """Take the cluster's slot map: from ``prefer`` first (the node that just dropped a
        channel knows where its slot went), then the URL's node, then every master known. Opens
        a connection to each master not connected yet, and places the jobs waiting for a map."""
        if not self.cluster:
            return
        async with self._slots_lock:
            if time.monotonic() - self._slots_at < max_age_s:
                return
            url = self._options
            candidates = [
                prefer,
                (url.get("host", "localhost"), int(url.get("port", 6379))),
                *self._masters(),
            ]
            error: BaseException | None = None
            for address in dict.fromkeys(a for a in candidates if a is not None):
                try:
                    self._slots = await self._slot_map(address)
                    self._slots_at = time.monotonic()
                    break
                except (RedisError, OSError) as e:
                    error = e
            else:
                raise RedisConnectionError(f"no cluster node gave its slot map (last: {error!r})")
        for address in self._masters() - self._links.keys():
            self._add_link(address)
        await self._move(self._unplaced)

    async def _slot_map(self, address: Address) -> list[Address | None]:
        client = Redis(
            connection_pool=ConnectionPool(
                **{**self._options, "host": address[0], "port": address[1]},
                socket_connect_timeout=SLOTS_TIMEOUT_S,
                socket_timeout=SLOTS_TIMEOUT_S,
            )
        )
        try:
            ranges = await client.execute_command("CLUSTER", "SLOTS")
        finally:
            await client.aclose()
            await client.connection_pool.disconnect()
        slots: list[Address | None] = [None] * CLUSTER_SLOTS
        for start, end, master, *_ in ranges:
            # An empty host: the node asked (it does not know the address it is reached at).
            host = _text(master[0]) or address[0]
            slots[int(start) : int(end) + 1] = [(host, int(master[1]))] * (int(end) - int(start) + 1)
        return slots

    def own_channel(self, address: Address | None) -> str:
        """The channel a connection keeps subscribed: on a cluster, one whose slot its node owns
        (a node refuses SSUBSCRIBE of another's channel), by a hash tag found by trying."""
        if address is None:
            return self._keys.hub_channel(self._client_name)
        for n in range(CLUSTER_SLOTS * 8):
            channel = self._keys.hub_channel(self._client_name, str(n))
            if self._slots[key_slot(channel)] == address:
                return channel
        raise RuntimeError(f"no hub channel name falls in a slot of {address} (a hash tag in the prefix?)")

    async def retire(self, link: _Link) -> None:
        """A node that owns no slot any more: its jobs go to their slots' new owners."""
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self.update_connected()
        jobs, link.jobs = set(link.jobs), set()
        await self._move(jobs)

    def route(self, channel: bytes, data: bytes) -> None:
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
            _put(inbox, item)

    def resync(self, jobs: Iterable[_JobStreams]) -> None:
        for job in jobs:
            for inbox in job.inboxes:
                _put(inbox, RESYNC)

    def by_channel(self, channel: str) -> _JobStreams | None:
        return self._by_channel.get(channel.encode())


def _put(inbox: Inbox, item: Item) -> None:
    try:
        inbox.put_nowait(item)
    except asyncio.QueueFull:
        # A stream this far behind re-reads the log; what was queued is in there too.
        while not inbox.empty():
            inbox.get_nowait()
        inbox.put_nowait(RESYNC)


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
        self.jobs: set[_JobStreams] = set()
        # Always subscribed: it keeps the connection listening when no job is watched, and its
        # confirmation after a (re)connection says every job channel asked with it is in place.
        self.own_channel = hub.own_channel(None) if address is None else ""
        self.pubsub: PubSub | None = None  # the current connection's, from its first SSUBSCRIBE on
        # Per channel, the subscriptions asked on this connection and not yet confirmed, oldest
        # first (Redis confirms a connection's SSUBSCRIBEs in the order they were sent), each
        # with whether its streams get RESYNC once it is.
        self.unconfirmed: dict[str, deque[tuple[_JobStreams, bool]]] = {}
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

    async def send(self, job: _JobStreams, command: str, resync: bool = False) -> None:
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
        groups: dict[int, list[_JobStreams]] = {}
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
