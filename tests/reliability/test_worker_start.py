"""A worker that cannot serve refuses to start, before it consumes anything.

Its model does not load: it exits non-zero at start with the reason, naming SPOOL_MODEL, and the
job queued before it stays queued with its message in the queue, for a worker that can run it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis
from procs import REDIS_URL, SPOOL, Prefixes, Service, spool_env, start, start_api, wait_until

from common.keys import Keys

BAD_MODEL = "/nonexistent/model"


@pytest.fixture
def r() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


def queued_messages(r: redis.Redis, keys: Keys) -> int:
    return sum(int(r.llen(name)) for name in keys.queue_lists(keys.queue_llm))


def test_a_worker_whose_model_does_not_load_exits_with_the_reason_before_taking_a_job(
    prefixes: Prefixes, log_dir: Path, r: redis.Redis, client: httpx.Client
) -> None:
    prefix = prefixes.new()
    keys = Keys(prefix)
    api = start_api(prefix, log_dir, ready=False)
    worker: Service | None = None
    try:
        posted = client.post(f"{api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4})
        assert posted.status_code == 202, posted.text
        job_id = posted.json()["id"]
        assert queued_messages(r, keys) == 1

        env = spool_env(prefix, model=BAD_MODEL, worker_name=f"{prefix}-bad", heartbeat_s=0.5)
        worker = start(f"worker-{prefix}-bad", [SPOOL, "worker"], env, log_dir)
        wait_until(lambda: not worker.alive(), "the worker to exit", 120)

        assert worker.proc.returncode == 78  # EX_CONFIG (workers/tasks.py)
        [line] = [x for x in worker.log_tail().splitlines() if "did not load" in x]
        assert f"SPOOL_MODEL='{BAD_MODEL}'" in line and "OSError" in line
        assert "ready." not in worker.log_tail()  # Celery's consumer never started
        assert not r.exists(keys.worker(f"{prefix}-bad"))  # never beat: never counted as ready
        assert client.get(f"{api.url}/v1/jobs/{job_id}").json()["status"] == "queued"
        assert r.hget(keys.job(job_id), "attempt") == "0"  # no worker took it
        assert queued_messages(r, keys) == 1  # its message waits for a worker that can run it
    finally:
        if worker is not None:
            worker.stop()
        api.stop()
