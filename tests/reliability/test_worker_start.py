"""A worker that cannot serve refuses to start, before it consumes anything.

Its model does not load: it exits non-zero at start with the reason, naming SPOOL_MODEL, and the
job queued before it stays queued with its message in the queue, for a worker that can run it.
Its compiled forward fails (no C++ compiler, as in the python:3.11-slim image): with SPOOL_COMPILE
unset it runs eagerly with a warning, with SPOOL_COMPILE=true that is a load failure.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis
from procs import (
    REDIS_URL,
    SPOOL,
    Prefixes,
    Service,
    finished_job,
    spool_env,
    start,
    start_api,
    start_worker,
    wait_until,
)

from common.keys import Keys
from common.settings import DEFAULT_SERVED_MODEL

pytestmark = pytest.mark.slow  # workers that fail to start (one compiles)

BAD_MODEL = "/nonexistent/model"
FALLBACK = "the compiled forward failed at load; the engine runs eagerly"


@pytest.fixture
def r() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


def queued_messages(r: redis.Redis, keys: Keys) -> int:
    """The messages in the default model's queue (the API's: no worker is live, none is named)."""
    return sum(int(r.llen(name)) for name in keys.queue_lists(keys.model_queue(DEFAULT_SERVED_MODEL)))


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
        [line] = [x for x in worker.log().splitlines() if "did not load" in x]
        assert f"SPOOL_MODEL='{BAD_MODEL}'" in line and "OSError" in line
        assert "ready." not in worker.log()  # Celery's consumer never started
        assert not r.exists(keys.worker(f"{prefix}-bad"))  # never beat: never counted as ready
        assert client.get(f"{api.url}/v1/jobs/{job_id}").json()["status"] == "queued"
        assert r.hget(keys.job(job_id), "attempt") == "0"  # no worker took it
        assert queued_messages(r, keys) == 1  # its message waits for a worker that can run it
    finally:
        if worker is not None:
            worker.stop()
        api.stop()


@pytest.fixture
def no_cxx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The workers started from here find no C++ compiler, so inductor cannot build the CPU
    kernels of the compiled forward; empty caches of their own (inductor's, and the user cache
    directory where the worker keeps compiled forwards), so nothing built earlier stands in."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.usefixtures("no_cxx")
def test_a_cpu_worker_whose_compile_fails_runs_eagerly_when_compile_is_unset(
    prefixes: Prefixes, log_dir: Path, tiny_model: Path, client: httpx.Client
) -> None:
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, compile=None, device="cpu")  # SPOOL_COMPILE unset
    api = start_api(prefix, log_dir)
    try:
        log = worker.log_path.read_text()
        [line] = [x for x in log.splitlines() if FALLBACK in x]
        assert "WARNING" in line
        assert "No working C++ compiler" in log  # the reason, in its traceback
        posted = client.post(
            f"{api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}
        )
        assert posted.status_code == 202, posted.text
        job = finished_job(client, api.url, posted.json()["id"])
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 4
    finally:
        api.stop()
        worker.stop()


@pytest.mark.usefixtures("no_cxx")
def test_a_worker_whose_compile_fails_exits_78_when_compile_is_true(
    prefixes: Prefixes, log_dir: Path, tiny_model: Path
) -> None:
    prefix = prefixes.new()
    env = spool_env(prefix, model=tiny_model, compile=True, device="cpu", worker_name=f"{prefix}-nocxx")
    worker = start(f"worker-{prefix}-nocxx", [SPOOL, "worker"], env, log_dir)
    try:
        wait_until(lambda: not worker.alive(), "the worker to exit", 120)
        assert worker.proc.returncode == 78  # EX_CONFIG: a load failure
        log = worker.log_path.read_text()
        [line] = [x for x in log.splitlines() if "did not load" in x]
        assert "No working C++ compiler" in line
        assert FALLBACK not in log
    finally:
        worker.stop()
