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

Each connection, its subscriptions and its reconnection: api/hub_links.py. The contract:
docs/internals.md#api-process-api.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from api.hub_links import RECONNECT_DELAY_S, Address, _Link, _settle, _text
from common.buckets import CLUSTER_SLOTS, key_slot
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
SLOTS_TIMEOUT_S = 2.0  # connect and answer, per node asked for the slot map


@dataclass(eq=False)
class _Job:
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
        self._jobs: dict[str, _Job] = {}
        self._by_channel: dict[bytes, _Job] = {}  # the same jobs by their channel, as messages name it
        self._links: dict[Address | None, _Link] = {}  # by node; one, under None, on a standalone Redis
        # Cluster only: each slot's master (None until the first map), when the map was taken, and
        # the jobs watched before it came (they go to their node's connection once it does).
        self._slots: list[Address | None] = [None] * CLUSTER_SLOTS
        self._slots_at = -math.inf
        self._slots_lock = asyncio.Lock()
        self._unplaced: set[_Job] = set()
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
            job = self._jobs[job_id] = self._by_channel[channel.encode()] = _Job(channel)
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

    async def _place(self, job: _Job, resync: bool) -> None:
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

    async def _move(self, jobs: Iterable[_Job]) -> None:
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

    def resync(self, jobs: Iterable[_Job]) -> None:
        for job in jobs:
            for inbox in job.inboxes:
                _put(inbox, RESYNC)

    def by_channel(self, channel: str) -> _Job | None:
        return self._by_channel.get(channel.encode())


def _put(inbox: Inbox, item: Item) -> None:
    try:
        inbox.put_nowait(item)
    except asyncio.QueueFull:
        # A stream this far behind re-reads the log; what was queued is in there too.
        while not inbox.empty():
            inbox.get_nowait()
        inbox.put_nowait(RESYNC)
