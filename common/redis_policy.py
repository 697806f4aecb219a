"""Redis settings Spool cannot run on, refused when a worker or an API process starts.

An eviction policy (any ``maxmemory-policy`` but ``noeviction``, such as ``allkeys-lru``) lets
Redis delete keys when it fills. It may take a running job's log, its hash, a worker's heartbeat
(which has a TTL, so even the ``volatile-*`` policies take it) or a queued Celery message. A
stream would then go silent or resume from nothing, and a job be lost without an error. With
``noeviction`` a full Redis refuses writes instead, which Spool survives. Workers retry, and the
API answers 503 (common/redis_errors.py). docs/operations.md#redis says what to set.

A Redis older than 7.0 is refused: job events go over sharded pub/sub (SPUBLISH inside the
store's scripts, SSUBSCRIBE in the API), which it does not have; every append would fail.

A node of a Redis Cluster is refused as the broker, since Celery's Redis transport does not speak
Cluster, and as the job data's Redis unless the broker is apart and the keys are laid out in
buckets (SPOOL_REDIS_BUCKETS, common/keys.py), so that each script's keys share a hash slot.
Without the check the first command on a key another node owns would fail with MOVED, at some
request or job, not at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aredis

from common.buckets import CLUSTER_BUCKETS
from common.keys import Keys
from common.settings import Settings
from common.store.clients import is_cluster_node, record_buckets, record_buckets_async

SAFE_POLICY = "noeviction"
MIN_VERSION = (7, 0)  # sharded pub/sub


class UnsafeRedis(RuntimeError):
    """Raised at start when Redis is configured to lose data Spool needs."""


def eviction_problem(memory_info: Mapping[str, Any]) -> str | None:
    """What is wrong with Redis's eviction policy (from INFO memory), or None."""
    policy = str(memory_info.get("maxmemory_policy", SAFE_POLICY))
    if policy == SAFE_POLICY:
        return None
    return (
        f"Redis evicts keys when it is full (maxmemory-policy {policy}): job logs, jobs and worker "
        f"heartbeats would vanish under running jobs. Set maxmemory-policy {SAFE_POLICY} (redis.conf, "
        f"or CONFIG SET maxmemory-policy {SAFE_POLICY}); a full Redis then refuses writes, which "
        "Spool waits out (503s from the API meanwhile)"
    )


def version_problem(server_info: Mapping[str, Any]) -> str | None:
    """What is wrong with Redis's version (from INFO server), or None."""
    version = str(server_info.get("redis_version", ""))
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # (a server that names its version otherwise: not refused on a guess)
    if major_minor >= MIN_VERSION:
        return None
    return (
        f"Redis {version} has no sharded pub/sub (SPUBLISH, SSUBSCRIBE), which job events go over: "
        f"Spool needs Redis {MIN_VERSION[0]}.{MIN_VERSION[1]} or later (docs/operations.md#redis)"
    )


def cluster_problem(cluster_info: Mapping[str, Any], settings: Settings, broker: bool) -> str | None:
    """What is wrong with a Redis Cluster node (from INFO cluster) as the broker (``broker``) or the
    job data's Redis, or None. The job data may be on a cluster, laid out in buckets, with the
    broker apart; Celery's Redis transport speaks no Redis Cluster."""
    if not is_cluster_node(cluster_info):
        return None
    if broker or not settings.broker_apart:
        return (
            "this Redis is a node of a Redis Cluster (cluster_enabled:1), and Celery's queues need a "
            "standalone Redis (its transport speaks no Redis Cluster): point SPOOL_BROKER_URL at a "
            "standalone redis-server; the job data (SPOOL_REDIS_URL) may stay on the cluster "
            "(docs/operations.md#redis)"
        )
    if settings.redis_buckets == 1:
        return (
            "the job data's Redis (SPOOL_REDIS_URL) is a node of a Redis Cluster, and its keys are laid "
            f"out in one bucket: set SPOOL_REDIS_BUCKETS={CLUSTER_BUCKETS} on every API and worker, so "
            "that each script's keys share a hash slot (docs/operations.md#redis)"
        )
    return None


def layout_problem(recorded: int, keys: Keys) -> str | None:
    """What is wrong with our number of buckets against the one the prefix's data was laid out in."""
    if recorded == keys.buckets:
        return None
    return (
        f"the job data of prefix {keys.prefix!r} is laid out in {recorded} bucket(s) (SPOOL_REDIS_BUCKETS), "
        f"and this process was started with {keys.buckets}: it would not see the others' jobs. Start every "
        f"API and worker of a prefix with the same SPOOL_REDIS_BUCKETS (docs/operations.md#redis)"
    )


def check_layout(client: redis.Redis, keys: Keys) -> None:
    """Raise UnsafeRedis when the job data's Redis holds another layout of the prefix (``Keys.layout``)."""
    if problem := layout_problem(record_buckets(client, keys), keys):
        raise UnsafeRedis(problem)


async def check_layout_async(client: aredis.Redis, keys: Keys) -> None:
    if problem := layout_problem(await record_buckets_async(client, keys), keys):
        raise UnsafeRedis(problem)


def check_redis(client: redis.Redis, settings: Settings, broker: bool = False) -> None:
    """Raise UnsafeRedis if Redis would evict keys, is older than 7.0 or is a cluster node it
    cannot be (``cluster_problem``); ``broker``: the broker's Redis, else the job data's. Needs only
    INFO (managed Redis may hide CONFIG)."""
    problem = (
        eviction_problem(client.info("memory"))
        or version_problem(client.info("server"))
        or cluster_problem(client.info("cluster"), settings, broker)
    )
    if problem:
        raise UnsafeRedis(problem)


async def check_redis_async(client: aredis.Redis, settings: Settings, broker: bool = False) -> None:
    problem = (
        eviction_problem(await client.info("memory"))
        or version_problem(await client.info("server"))
        or cluster_problem(await client.info("cluster"), settings, broker)
    )
    if problem:
        raise UnsafeRedis(problem)
