"""Worker names: the default is unique per process, and a name a live worker holds is refused.

A name keys a worker's heartbeat and marks its jobs, and a starting worker releases the leases
of the running jobs under its name (its earlier run's). Two live workers under one name renewed
each other's leases and released each other's jobs: runs stuck `running` for good, runs twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis
from procs import (
    SPOOL,
    Prefixes,
    Service,
    finished_job,
    heartbeat_pids,
    heartbeats,
    spool_env,
    start,
    start_api,
    wait_until,
)

from common.keys import Keys

pytestmark = pytest.mark.slow  # several workers started

PROMPT = "the quick brown fox"


def start_unwatched(prefix: str, log_dir: Path, label: str, **settings: object) -> Service:
    """``spool worker``, without waiting for its heartbeat (the test says what it waits for)."""
    env = spool_env(prefix, heartbeat_s=0.5, **settings)
    return start(f"worker-{prefix}-{label}", [SPOOL, "worker"], env, log_dir)


def test_two_workers_with_the_default_name_on_one_host_are_two_workers(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, redis_client: redis.Redis, client: httpx.Client
) -> None:
    prefix = prefixes.new()
    keys = Keys(prefix)
    workers = [
        start_unwatched(prefix, log_dir, f"default{i}", model=tiny_model, max_batch_size=4) for i in (1, 2)
    ]
    api = start_api(prefix, log_dir, ready=False)
    try:
        wait_until(lambda: len(heartbeats(redis_client, keys)) == 2, "two heartbeats", 120, tuple(workers))
        names = heartbeat_pids(redis_client, keys)
        assert set(names) == {w.proc.pid for w in workers}
        assert all(n.startswith("spool-") for n in names.values())
        assert len(api_workers(client, api.url)) == 2
        jobs = [
            client.post(f"{api.url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": 64, "temperature": 0})
            for _ in range(8)
        ]
        done = [finished_job(client, api.url, j.json()["id"]) for j in jobs]
        assert [j["status"] for j in done] == ["succeeded"] * 8
        assert len({j["text"] for j in done}) == 1  # greedy: the same text, whichever worker ran it
    finally:
        api.stop()
        for w in workers:
            w.stop()


def test_a_worker_refuses_a_name_that_a_live_worker_holds(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, redis_client: redis.Redis
) -> None:
    prefix = prefixes.new()
    key = Keys(prefix).worker(f"{prefix}-same")
    named = {"model": tiny_model, "worker_name": f"{prefix}-same"}
    holder = start_unwatched(prefix, log_dir, "same", **named)
    second: Service | None = None
    try:
        wait_until(lambda: bool(redis_client.exists(key)), "the first worker's heartbeat", 120, (holder,))
        second = start_unwatched(prefix, log_dir, "same-again", **named)
        wait_until(lambda: not second.alive(), "the second worker to exit", 120, (holder,))
        assert second.proc.returncode == 78  # EX_CONFIG (workers/tasks.py)
        [line] = [x for x in second.log().splitlines() if "held by a live worker" in x]
        assert f"SPOOL_WORKER_NAME='{prefix}-same'" in line and f"pid {holder.proc.pid}" in line
        assert "ready." not in second.log()
        assert holder.alive()
        assert json.loads(redis_client.get(key) or "{}")["pid"] == holder.proc.pid  # untouched
    finally:
        if second is not None:
            second.stop()
        holder.stop()


def api_workers(client: httpx.Client, url: str) -> list[dict[str, object]]:
    workers: list[dict[str, object]] = client.get(f"{url}/readyz").json()["workers"]
    return workers
