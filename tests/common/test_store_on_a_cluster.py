"""The worker's store on a real Redis Cluster (three masters, the broker on the tests' Redis
apart): an engine step's writes are one script call per master, whatever buckets the step's jobs
are in (common/store/steps.py); a slot that moved under the writer's slot map goes again as one
call per bucket, and nothing is lost or written twice; a job's parts end as on one Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from procs import REDIS_URL
from redis_cluster import Cluster, redis_cluster
from store_helpers import StoreForTests
from test_parts_store import IMAGE, MODEL, TEXT, end_image, end_text, get, run

from common.buckets import CLUSTER_BUCKETS, key_slot
from common.keys import part_id
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus
from common.settings import Settings, load_settings
from common.store import Append, Appended, QueueMessage, TakeStatus, token_entry
from common.store.clients import ASYNC_POOL_SIZE, async_data_client
from common.store.outbox import outboxed
from spool_cli import procs as harness


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with redis_cluster(tmp_path) as c:
        yield c


@pytest.fixture
def settings(cluster: Cluster, prefixes) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=cluster.url,
        broker_url=REDIS_URL,
        redis_prefix=prefixes.new(),
        redis_buckets=CLUSTER_BUCKETS,
        job_ttl_s=60,
        lease_s=30,
    )


@contextmanager
def _store(settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(settings)
    assert isinstance(s.redis, redis.RedisCluster)
    try:
        yield s
    finally:
        s.close()


def _step(jobs: list[str], seq: int) -> list[Append]:
    return [Append(j, 1, [token_entry(seq, seq - 1, f"{seq}", [seq])], 3, seq) for j in jobs]


def _script_calls(cluster: Cluster) -> list[int]:
    """EVALSHA and EVAL calls per master since the last CONFIG RESETSTAT."""
    counts = []
    for port in cluster.ports:
        with redis.Redis(port=port, decode_responses=True) as node:
            stats = node.info("commandstats")
            counts.append(sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval")))
    return counts


def test_a_step_is_one_script_call_per_master(settings: Settings, cluster: Cluster) -> None:
    with _store(settings) as store:
        jobs = [store.create_job(JobRequest(prompt=f"job {i}")).id for i in range(48)]
        for j in jobs:
            store.take_job(j, "w1", "tiny")
        assert len({store.keys.bucket_of(j) for j in jobs}) > 3 * 3  # several buckets on each master
        # The first step loads the script on each master (NOSCRIPT, then EVAL).
        assert store.append_batch(_step(jobs, 1)) == [Appended.WRITTEN] * len(jobs)
        for port in cluster.ports:
            with redis.Redis(port=port) as node:
                node.config_resetstat()
        assert store.append_batch(_step(jobs, 2)) == [Appended.WRITTEN] * len(jobs)
        assert _script_calls(cluster) == [1, 1, 1]
        # The same step again (a retry after a dropped connection) writes nothing twice.
        assert store.append_batch(_step(jobs, 2)) == [Appended.WRITTEN] * len(jobs)
        assert all(store.redis.llen(store.keys.job_log(j)) == 2 for j in jobs)
        assert {store.get_job(j).text for j in jobs} == {"12"}


def test_a_slot_moved_under_the_writer_goes_per_bucket(settings: Settings, cluster: Cluster) -> None:
    """A bucket's slot handed to another master (as a resharding does) after the writer read the
    slot map: the call for the bucket's old master fails before any write, and its jobs go again
    per bucket, routed by the cluster client."""
    keys = settings.keys
    with _store(settings) as writer, _store(settings) as api:
        jobs = [api.create_job(JobRequest(prompt=f"job {i}")).id for i in range(24)]
        writer.take_job(jobs[0], "w1", "tiny")  # the writer's slot map, read before the move
        # A bucket none of the jobs is in holds no key yet: CLUSTER SETSLOT alone moves its slot.
        free = next(b for b in keys.bucket_range() if b not in {keys.bucket_of(j) for j in jobs})
        slot = key_slot(keys.running_jobs(free))
        owner = writer.redis.nodes_manager.get_node_from_slot(slot)  # type: ignore[attr-defined]
        target = next(p for p in cluster.ports if p != owner.port)
        _give_slot(cluster, slot, target)
        # Jobs in that bucket, made and taken by a client that follows the move.
        moved = [
            j
            for j in (api.create_job(JobRequest(prompt="moved")).id for _ in range(120))
            if keys.bucket_of(j) == free
        ]
        assert moved
        for j in [*jobs[1:], *moved]:
            api.take_job(j, "w1", "tiny")
        assert writer.redis.nodes_manager.get_node_from_slot(slot).port == owner.port  # type: ignore[attr-defined]
        step = _step([*jobs, *moved], 1)
        assert writer.append_batch(step) == [Appended.WRITTEN] * len(step)
        assert writer.redis.nodes_manager.get_node_from_slot(slot).port == target  # type: ignore[attr-defined]
        assert all(
            api.get_job(j).text == "1" and api.redis.llen(keys.job_log(j)) == 1 for j in [*jobs, *moved]
        )


def _give_slot(cluster: Cluster, slot: int, port: int) -> None:
    """Hand an empty slot to the master at ``port``, and wait until every master says so."""
    with redis.Redis(port=port, decode_responses=True) as node:
        target = node.execute_command("CLUSTER", "MYID")
    for p in cluster.ports:
        with redis.Redis(port=p) as node:
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)

    def agreed() -> bool:
        for p in cluster.ports:
            with redis.Redis(port=p) as node:
                ranges = node.execute_command("CLUSTER", "SLOTS")
            if not any(r[0] <= slot <= r[1] and r[2][1] == port for r in ranges):
                return False
        return True

    harness.wait_until(agreed, f"slot {slot} on the master at {port}", 10, cluster.procs)


def test_a_job_with_parts_ends_partial_on_a_cluster(settings: Settings) -> None:
    """A text part and an image part (their scripts, the outbox to the broker apart) on a cluster:
    text succeeded, image failed is ``partial``, with one log for both."""
    keys = settings.keys
    request = JobRequest.accept({"parts": [TEXT, IMAGE]}, settings)
    # The API's messages with the broker apart: on the outbox of the job's bucket (api/enqueue.py).
    queue = keys.model_queue(MODEL)

    def llm(pid: str) -> QueueMessage:
        return outboxed(keys, QueueMessage(queue, f"text {pid}", queue), pid)

    def media(pid: str, held: bool) -> QueueMessage:
        return outboxed(keys, QueueMessage(keys.queue_media, f"image {pid}"), pid)

    job: Job = run(settings, lambda api: api.create_job(request, "", llm, None, media))
    text, image = part_id(job.id, 0), part_id(job.id, 1)
    with _store(settings) as store:
        t = store.take_job(text, "w", MODEL)
        i = store.take_job(image, "m1", "sd")
        assert t.status is TakeStatus.TAKEN and i.status is TakeStatus.TAKEN
        assert end_text(store, text, t.attempt, 1, JobStatus.SUCCEEDED)
        assert end_image(store, image, i.attempt, 1, JobStatus.FAILED)
        log = store.read_log(job.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and log[-1].data["status"] == "partial"
    final = get(settings, job.id)
    assert final.status is JobStatus.PARTIAL and final.text == "tok"
    assert [p["status"] for p in final.parts] == ["succeeded", "failed"]


def test_a_burst_past_the_pool_waits_rather_than_fails(cluster: Cluster, settings: Settings) -> None:
    """The API's cluster client with more commands and pipelines at once than it has connections
    to a node (``ASYNC_POOL_SIZE``): each waits for a free one (redis-py's own raises "Too many
    connections", which the API answered with a 500)."""
    key = settings.keys.job("burst")

    async def burst() -> list[Any]:
        client = async_data_client(cluster.url)
        try:
            await client.set(key, "x")

            async def piped() -> list[Any]:
                pipe = client.pipeline()
                pipe.get(key)
                pipe.exists(key)
                return list(await pipe.execute())

            calls = [client.get(key) for _ in range(2 * ASYNC_POOL_SIZE)]
            calls += [piped() for _ in range(ASYNC_POOL_SIZE)]
            return list(await asyncio.gather(*calls))
        finally:
            await client.delete(key)
            await client.aclose()

    answers = asyncio.run(burst())
    assert answers == ["x"] * (2 * ASYNC_POOL_SIZE) + [["x", 1]] * ASYNC_POOL_SIZE
