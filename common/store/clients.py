"""The Redis clients of the stores: retries, timeouts and the API's connection pool."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any, cast

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterPipeline
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from common.keys import Keys

# NOTE: clients made with from_url retry nothing unless told to. After a Redis restart every
# pooled connection is dead; without retries each one fails its next command (pipelines too)
# once, so the API would answer 503s for a while after Redis is back. A retry reconnects at once.
# Every script is safe to run twice (appends check the seq, takes return the attempt they set).
REDIS_RETRIES = 3
REDIS_BACKOFF = {"base": 0.05, "cap": 0.5}  # seconds
# No command of the store blocks in Redis, so an answer slower than this means a dead or
# half-open connection: fail (and retry on a new one) rather than hang a worker or a request.
REDIS_TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}


ASYNC_POOL_SIZE = 128  # Redis connections per API process
WRITE_PROBE_TTL_MS = 10_000  # the /readyz write probe's key (AsyncJobStore.probe_write) expires
ASYNC_POOL_WAIT_S = 10.0  # how long a command waits for one before it fails


def record_buckets(client: redis.Redis, keys: Keys) -> int:
    """The number of buckets this prefix's job data is laid out in (``Keys.layout``): ours, if we
    are the first to say."""
    client.set(keys.layout(), keys.buckets, nx=True)
    return int(client.get(keys.layout()) or keys.buckets)


async def record_buckets_async(client: aredis.Redis, keys: Keys) -> int:
    await client.set(keys.layout(), keys.buckets, nx=True)
    return int(await client.get(keys.layout()) or keys.buckets)


def on_cluster(url: str) -> bool:
    """Whether ``url`` names a node of a Redis Cluster (``INFO cluster``), asked once per process
    and URL. A Redis not reachable yet is taken for a standalone one (the start-up check, which
    runs before, says so): start the job data's cluster before Spool."""
    return _on_cluster(url)


@functools.cache
def _on_cluster(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5) as probe:
            return is_cluster_node(probe.info("cluster"))
    except redis.RedisError:
        return False


def is_cluster_node(cluster_info: Mapping[str, Any]) -> bool:
    """Whether Redis is a node of a Redis Cluster (from INFO cluster)."""
    return bool(int(cluster_info.get("cluster_enabled", 0)))


def data_client(url: str) -> redis.Redis:
    """The job data's client: a cluster client on a Redis Cluster (every script's keys share a
    slot: common/keys.py on buckets), else ``sync_client``'s."""
    if not on_cluster(url):
        return sync_client(url)
    retry = Retry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    cluster = redis.RedisCluster.from_url(url, decode_responses=True, retry=retry, **REDIS_TIMEOUTS)
    # NOTE: a RedisCluster is no redis.Redis, but has its commands, pipelines, scripts and pub/sub;
    # the stores use no command it lacks (a pipeline's TIME, MGET across slots).
    return cast(redis.Redis, cluster)


class _WaitingCluster(aredis.RedisCluster):
    """redis.asyncio's cluster client, but a command (or pipeline) past ``ASYNC_POOL_SIZE`` at once
    waits for one to end, as ``async_client``'s blocking pool makes it wait.

    NOTE: the cluster client raises MaxConnectionsError ("Too many connections") for a command
    that finds its node's ``max_connections`` in use; the API answered such a burst with 500s (seen
    with 128 streams opened at once on one API). Each command and each pipeline uses at most one
    connection of a node, so holding one of ``ASYNC_POOL_SIZE`` permits keeps every node within."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.room = asyncio.Semaphore(ASYNC_POOL_SIZE)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.room:
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # which refuses it
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]


class _WaitingPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with cast(_WaitingCluster, self.cluster_client).room:
            return await super().execute(raise_on_error, allow_redirections)


def async_data_client(url: str) -> aredis.Redis:
    """The API's job data client: ``data_client``'s choice, over redis.asyncio."""
    if not on_cluster(url):
        return async_client(url)
    retry = AsyncRetry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    cluster = _WaitingCluster.from_url(
        url, decode_responses=True, retry=retry, max_connections=ASYNC_POOL_SIZE, **REDIS_TIMEOUTS
    )
    return cast(aredis.Redis, cluster)


def sync_client(url: str) -> redis.Redis:
    retry = Retry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    return redis.Redis.from_url(url, decode_responses=True, retry=retry, **REDIS_TIMEOUTS)


def async_client(url: str) -> aredis.Redis:
    retry = AsyncRetry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    # NOTE: the default async pool fails the 101st concurrent command with "Too many
    # connections", which the API would report as Redis being down (seen with 1,000 open
    # streams). A blocking pool makes a burst wait for a free connection instead.
    pool = aredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        retry=retry,
        max_connections=ASYNC_POOL_SIZE,
        timeout=ASYNC_POOL_WAIT_S,
        **REDIS_TIMEOUTS,
    )
    return aredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


def answers(url: str, timeout_s: float) -> bool:
    """Whether the Redis at ``url`` answers a PING within ``timeout_s`` (one try, no retry): for a
    process that must tell a Redis gone from a slow one (workers/task_common.py StopBound)."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
