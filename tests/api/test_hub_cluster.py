"""The API's pub/sub hub on a real Redis Cluster of three masters: one connection per master, each
job channel subscribed on the node that owns its slot, and a dropped node connection or a moved
slot costs a RESYNC to the streams of that node (or slot) only.

The hub runs in this process (the API refuses a cluster at start for now); messages come
through redis-py's own cluster client, as a worker's scripts would SPUBLISH them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis_cluster import Cluster, redis_cluster

from api.hub import RESYNC, Hub, Inbox, Item
from common.buckets import key_slot
from common.keys import Keys
from common.schemas.events import LogEntry
from common.store import token_entry

KEYS = Keys("test-hub-cluster")
NAME = "test-hub-cluster-api-hub-1"
PER_NODE = 2  # jobs whose channel's slot each master owns
WAIT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with redis_cluster(tmp_path_factory.mktemp("hub-cluster")) as nodes:
        yield nodes


def owners(cluster: Cluster) -> dict[int, int]:
    """Each slot's master, by its port (CLUSTER SLOTS of one node)."""
    with redis.Redis.from_url(cluster.url) as node:
        ranges = node.execute_command("CLUSTER", "SLOTS")
    return {slot: int(master[1]) for start, end, master, *_ in ranges for slot in range(start, end + 1)}


def jobs_by_node(cluster: Cluster) -> dict[int, list[str]]:
    """PER_NODE job ids per master (by port) whose events channel's slot that master owns."""
    owner = owners(cluster)
    by_node: dict[int, list[str]] = {port: [] for port in cluster.ports}
    n = 0
    while any(len(jobs) < PER_NODE for jobs in by_node.values()):
        job_id, n = f"job{n}", n + 1
        jobs = by_node[owner[key_slot(KEYS.job_events(job_id))]]
        if len(jobs) < PER_NODE:
            jobs.append(job_id)
    return by_node


def hub_clients(port: int) -> list[dict[str, str]]:
    with redis.Redis(port=port, decode_responses=True) as node:
        return [c for c in node.client_list() if c["name"] == NAME]


def entry(job_id: str, seq: int) -> LogEntry:
    return token_entry(seq, seq - 1, f"{job_id}:{seq}", [seq])


async def next_item(inbox: Inbox) -> Item:
    return await asyncio.wait_for(inbox.get(), WAIT_S)


async def publish_all(client: RedisCluster, jobs: list[str], seq: int) -> None:
    for job_id in jobs:
        assert await client.spublish(KEYS.job_events(job_id), entry(job_id, seq).encode()) == 1


async def until(check: object, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():  # type: ignore[operator]
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_hub(cluster: Cluster) -> AsyncIterator[tuple[Hub, RedisCluster]]:
    """A hub on the cluster, and a cluster client to publish with; both closed on exit."""
    hub = Hub(cluster.url, KEYS, NAME, cluster=True)
    client = RedisCluster.from_url(cluster.url)
    await hub.start()
    try:
        yield hub, client
    finally:
        await hub.stop()
        await client.aclose()


@contextlib.asynccontextmanager
async def watching(hub: Hub, jobs: list[str]) -> AsyncIterator[dict[str, Inbox]]:
    """One stream per job (its inbox), entered once every connection is subscribed, with the
    first connections' RESYNC (nothing missed yet) taken out."""
    async with contextlib.AsyncExitStack() as stack:
        inboxes = {job_id: await stack.enter_async_context(hub.watch(job_id)) for job_id in jobs}
        await asyncio.wait_for(hub.connected.wait(), WAIT_S)
        for inbox in inboxes.values():
            while not inbox.empty():
                assert inbox.get_nowait() is RESYNC
        yield inboxes


def test_each_job_channel_is_on_its_slots_master_and_a_dropped_node_resyncs_its_streams_only(
    cluster: Cluster,
) -> None:
    by_node = jobs_by_node(cluster)
    jobs = [job_id for ids in by_node.values() for job_id in ids]

    async def scenario() -> None:
        async with running_hub(cluster) as (hub, client):
            async with watching(hub, jobs) as inboxes:
                # One connection per master, holding its own channel and the channels of its slots.
                for port in cluster.ports:
                    assert [c["ssub"] for c in hub_clients(port)] == [str(1 + PER_NODE)], port

                # Every message reaches its job's stream, and no other.
                for seq in (1, 2):
                    await publish_all(client, jobs, seq)
                    for job_id in jobs:
                        assert await next_item(inboxes[job_id]) == entry(job_id, seq)

                # One node drops the hub's connection: its streams get RESYNC once it is back.
                killed, *others = cluster.ports
                [old] = hub_clients(killed)
                with redis.Redis(port=killed) as node:
                    node.client_kill_filter(_id=old["id"])
                for job_id in by_node[killed]:
                    assert await next_item(inboxes[job_id]) is RESYNC
                assert hub.reconnects == 1 and hub.connected.is_set()
                [new] = hub_clients(killed)
                assert new["id"] != old["id"] and new["ssub"] == str(1 + PER_NODE)

                # Later messages reach every stream again; the other nodes' streams saw no RESYNC.
                await publish_all(client, jobs, 3)
                for job_id in jobs:
                    assert await next_item(inboxes[job_id]) == entry(job_id, 3)
                    assert inboxes[job_id].empty()

            # The last stream of each job gone, no job channel stays subscribed (own channels only).
            await until(
                lambda: all([c["ssub"] for c in hub_clients(p)] == ["1"] for p in cluster.ports),
                "every job channel unsubscribed",
            )
        assert all(hub_clients(port) == [] for port in cluster.ports)

    asyncio.run(scenario())


def move_slot(cluster: Cluster, slot: int, source: int, target: int) -> None:
    """Move an empty slot from one master to another, as a resharding does (redis-cli --cluster
    reshard): IMPORTING on the target, MIGRATING on the source, then NODE on every node."""
    nodes = {port: redis.Redis(port=port) for port in cluster.ports}
    try:
        ids = {port: node.execute_command("CLUSTER", "MYID").decode() for port, node in nodes.items()}
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        for port in (target, source, *(p for p in cluster.ports if p not in (source, target))):
            nodes[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    finally:
        for node in nodes.values():
            node.close()


def test_a_moved_slot_resubscribes_its_channels_on_the_new_owner_and_resyncs_their_streams_only(
    cluster: Cluster,
) -> None:
    """A slot leaving a node (resharding, failover) makes the node drop its shard channels
    (a server-sent SUNSUBSCRIBE): the hub subscribes them where the slot went."""
    by_node = jobs_by_node(cluster)
    jobs = [job_id for ids in by_node.values() for job_id in ids]
    source, target, _ = cluster.ports
    moved, stays = by_node[source]
    slot = key_slot(KEYS.job_events(moved))
    assert slot != key_slot(KEYS.job_events(stays))

    async def scenario() -> None:
        async with running_hub(cluster) as (hub, client), watching(hub, jobs) as inboxes:
            before = {port: hub_clients(port) for port in cluster.ports}

            await asyncio.to_thread(move_slot, cluster, slot, source, target)
            assert await next_item(inboxes[moved]) is RESYNC
            # The same connections: the moved channel left the source's and joined the target's.
            after = {port: hub_clients(port) for port in cluster.ports}
            assert [[c["id"] for c in clients] for clients in after.values()] == [
                [c["id"] for c in clients] for clients in before.values()
            ]
            assert [c["ssub"] for c in after[source]] == [str(PER_NODE)]
            assert [c["ssub"] for c in after[target]] == [str(2 + PER_NODE)]
            assert hub.reconnects == 0

            # Messages reach every stream (the moved one's from its new node); no other RESYNC.
            await publish_all(client, jobs, 1)
            for job_id in jobs:
                assert await next_item(inboxes[job_id]) == entry(job_id, 1)
                assert inboxes[job_id].empty()

    asyncio.run(scenario())
