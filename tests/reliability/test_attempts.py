"""A job that kills every worker that takes it fails after SPOOL_MAX_ATTEMPTS takes; others run on.

The killing is the watchdog's: workers started with ``SPOOL_ENGINE_STALL_S`` at 1 ms exit with
status 70 at their first step, whatever the job, as a worker does whose step one request makes
too long (a 1024x1024 image on a CPU). Each exit leaves the job to the next worker's sweep, and
each take counts as an attempt; with ``SPOOL_MAX_ATTEMPTS=2`` the third take, by a healthy
worker, fails the job with ``too_many_attempts`` instead of running it, and that worker goes on
with the next job.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import SHORT_LEASES
from procs import REDIS_URL, SPOOL, Prefixes, Service, finished_job, spool_env, start, start_api, wait_until

from common.keys import Keys

pytestmark = pytest.mark.slow  # workers killed by their jobs, again and again

MAX_ATTEMPTS = 2
STALLS = {"engine_stall_s": 0.001}


class Pool:
    """Workers of one kind on a prefix of their own, started one after another, and an API."""

    def __init__(self, prefix: str, log_dir: Path, kind: str, model: dict[str, Path]) -> None:
        self.prefix, self.log_dir, self.kind, self.model = prefix, log_dir, kind, model
        self.started: list[Service] = []
        # The API is told the model too: a job sent while no worker is live goes to its queue.
        self.api = start_api(prefix, log_dir, ready=False, **model)

    def start(self, name: str, **settings: object) -> Service:
        env = spool_env(
            self.prefix,
            worker_name=f"{self.prefix}-{name}",
            heartbeat_s=0.5,
            max_attempts=MAX_ATTEMPTS,
            **SHORT_LEASES,
            **self.model,
            **settings,
        )
        env["OMP_NUM_THREADS"] = "1"
        argv = [SPOOL, "worker"] + (["--kind", "media"] if self.kind == "media" else [])
        worker = start(f"{self.kind}-{self.prefix}-{name}", argv, env, self.log_dir)
        self.started.append(worker)
        return worker

    def stop(self) -> None:
        self.api.stop()
        for w in self.started:
            w.stop()


@pytest.fixture
def pool(request: pytest.FixtureRequest, prefixes: Prefixes, log_dir: Path) -> Iterator[Pool]:
    kind = request.param
    model = (
        {"image_model": request.getfixturevalue("tiny_image_model")}
        if kind == "media"
        else {"model": request.getfixturevalue("tiny_model")}
    )
    p = Pool(prefixes.new(), log_dir, kind, model)
    yield p
    p.stop()


# Long enough that no stalling worker finishes the job in the moments its watchdog takes to exit
# (8 tokens could: the job then succeeded before its third take, a flake under load).
JOBS: dict[str, dict[str, Any]] = {
    "text": {
        "prompt": "once upon a time",
        "max_tokens": 400,
        "min_tokens": 400,
        "temperature": 0,
        "background": True,
    },
    "media": {"parts": [{"type": "image", "prompt": "a", "size": "32x32", "steps": 12}], "background": True},
}


def error_of(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job["parts"][0]["error"] if job["parts"] else job["error"])


@pytest.mark.parametrize("pool", ["text", "media"], indirect=True)
def test_a_job_that_kills_its_workers_fails_after_max_attempts(
    pool: Pool, client: httpx.Client, figures: dict[str, Any]
) -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    body = JOBS[pool.kind]
    poison = client.post(f"{pool.api.url}/v1/jobs", json=body).json()["id"]
    key = Keys(pool.prefix).job(poison if pool.kind == "text" else f"{poison}:part:0")
    for k in range(1, MAX_ATTEMPTS + 1):
        stalls = pool.start(f"stalls-{k}", **STALLS)
        wait_until(lambda w=stalls: not w.alive(), f"worker {k} to stall on the job and exit", 120)
        assert stalls.proc.returncode == 70, stalls.log_tail()
        assert r.hget(key, "attempt") == str(k)
    healthy = pool.start("healthy")
    job = finished_job(client, pool.api.url, poison, timeout=120)
    assert job["status"] == "failed", job
    error = error_of(job)
    assert error["type"] == "too_many_attempts" and f"SPOOL_MAX_ATTEMPTS={MAX_ATTEMPTS}" in error["message"]
    assert r.hget(key, "attempt") == str(MAX_ATTEMPTS + 1)
    # The healthy worker is not ended by it, and runs the next job.
    other = client.post(f"{pool.api.url}/v1/jobs", json=body).json()["id"]
    assert finished_job(client, pool.api.url, other, timeout=60)["status"] == "succeeded"
    assert healthy.alive()
    figures[f"max_attempts_{pool.kind}"] = (
        f"failed at take {MAX_ATTEMPTS + 1} after {MAX_ATTEMPTS} watchdog exits"
    )
