"""A Redis that evicts keys when it fills, or a node of a Redis Cluster where it cannot serve, is
refused at start, by the worker and by the API.

With ``allkeys-lru`` or ``volatile-lru`` a full Redis deletes keys: a running job's log, a
worker's heartbeat (it has a TTL). A stream would go silent, a job vanish without an error. So a
worker or an API started on such a Redis exits at once, naming ``maxmemory-policy``. A cluster as
the broker, or as the job data's Redis without buckets, would fail the first command on a key of
another node's slots (MOVED), at some request or job.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from breakers import RedisServer
from procs import SPOOL, free_port, spool_env
from redis_cluster import redis_cluster

from common.keys import Keys
from common.redis_policy import UnsafeRedis, check_layout, check_redis, eviction_problem, version_problem
from common.settings import load_settings

START_S = 60.0  # a refused start exits long before this; a start that is not refused runs on


@pytest.fixture(scope="module")
def lru_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-lru"), "--appendonly", "no")
    server.start()
    yield server
    server.close()


def run(argv: list[str], redis_url: str) -> subprocess.CompletedProcess[str]:
    env = spool_env("test-policy", redis_url=redis_url)
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=START_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv[1]} started on a Redis that evicts keys")


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
@pytest.mark.parametrize("command", ["worker", "api"])
def test_a_redis_that_evicts_keys_is_refused_at_start(
    lru_redis: RedisServer, policy: str, command: str
) -> None:
    lru_redis.client.config_set("maxmemory-policy", policy)
    argv = [SPOOL, command] + (["--port", str(free_port())] if command == "api" else [])
    done = run(argv, lru_redis.url)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"maxmemory-policy {policy}" in done.stderr and "noeviction" in done.stderr


def test_the_apps_own_start_refuses_it_too(lru_redis: RedisServer) -> None:
    """A bare ``uvicorn api.main:app`` (no `spool api`) fails its start the same way."""
    lru_redis.client.config_set("maxmemory-policy", "allkeys-lru")
    argv = [sys.executable, "-m", "uvicorn", "api.main:app", "--port", str(free_port())]
    done = run(argv, lru_redis.url)
    assert done.returncode != 0 and "maxmemory-policy allkeys-lru" in done.stderr


def test_noeviction_is_accepted(lru_redis: RedisServer) -> None:
    settings = load_settings(redis_url=lru_redis.url)
    lru_redis.client.config_set("maxmemory-policy", "noeviction")
    check_redis(lru_redis.client, settings)
    assert eviction_problem({"maxmemory_policy": "volatile-ttl"}) is not None
    with pytest.raises(UnsafeRedis, match="allkeys-random"):
        lru_redis.client.config_set("maxmemory-policy", "allkeys-random")
        check_redis(lru_redis.client, settings)


def test_a_redis_without_sharded_pub_sub_is_refused() -> None:
    """Job events go over SPUBLISH/SSUBSCRIBE (Redis 7.0): an older Redis would fail every append."""
    assert "7.0 or later" in (version_problem({"redis_version": "6.2.14"}) or "")
    assert version_problem({"redis_version": "7.0.15"}) is None
    assert version_problem({"redis_version": "10.1.0"}) is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis Cluster of three masters on free ports; yields one node's URL."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes.url


# (which Redis is the cluster, whether the broker is apart, the buckets) -> what the refusal names
REFUSALS = {
    "data-and-broker": (["SPOOL_REDIS_URL"], "standalone"),
    "broker": (["SPOOL_BROKER_URL"], "standalone"),
    "data-in-one-bucket": (["SPOOL_REDIS_URL", "SPOOL_BROKER_URL apart"], "SPOOL_REDIS_BUCKETS=24"),
}


@pytest.mark.parametrize("case", REFUSALS)
@pytest.mark.parametrize("command", ["worker", "api"])
def test_a_redis_cluster_is_refused_at_start_where_it_cannot_serve(
    cluster: str, lru_redis: RedisServer, case: str, command: str
) -> None:
    """A cluster node is refused with what to do, not found out at the first MOVED of some request:
    as the broker (Celery speaks no Redis Cluster), and as the job data's Redis unless the broker
    is apart and the keys are in buckets (tests/reliability/test_job_data_on_a_cluster.py runs
    that)."""
    lru_redis.client.config_set("maxmemory-policy", "noeviction")
    roles, named = REFUSALS[case]
    argv = [SPOOL, command] + (["--port", str(free_port())] if command == "api" else [])
    env = spool_env("test-policy", redis_url=cluster if "SPOOL_REDIS_URL" in roles else lru_redis.url)
    if "SPOOL_BROKER_URL" in roles:
        env["SPOOL_BROKER_URL"] = cluster
    if "SPOOL_BROKER_URL apart" in roles:
        env["SPOOL_BROKER_URL"] = lru_redis.url
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=START_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} started on a Redis Cluster")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Redis Cluster" in done.stderr and named in done.stderr


@pytest.mark.parametrize("command", ["worker", "api"])
def test_another_number_of_buckets_is_refused_at_start(lru_redis: RedisServer, command: str) -> None:
    """A prefix's job data laid out in one bucket (as the first process recorded it): a process
    started with SPOOL_REDIS_BUCKETS=24 would look for every job under other names."""
    lru_redis.client.config_set("maxmemory-policy", "noeviction")
    keys = Keys("test-layout")
    check_layout(lru_redis.client, keys)  # the first to start records its number
    assert lru_redis.client.get(keys.layout()) == "1"
    check_layout(lru_redis.client, keys)  # the same number agrees
    argv = [SPOOL, command] + (["--port", str(free_port())] if command == "api" else [])
    env = {**spool_env(keys.prefix, redis_url=lru_redis.url), "SPOOL_REDIS_BUCKETS": "24"}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=START_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} started with another number of buckets")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "laid out in 1 bucket(s)" in done.stderr and "SPOOL_REDIS_BUCKETS" in done.stderr
