"""A worker told to stop (SIGTERM, Celery's warm shutdown) while Redis is unreachable exits within
a bound, with a non-zero status, and says so in its log.

It runs on a redis-server of the test's own, which the test kills while the worker runs a long job
(its task thread waits for the job's end, which the writer cannot write). Before the bound the
warm shutdown waited for good. The job's lease lapses in Redis, as a killed worker's, so the
usual take-over (test_worker_crash.py) runs it on once Redis is back.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from breakers import SHORT_LEASES, RedisServer
from procs import Prefixes, Service, start_api, start_worker, wait_until

from workers.task_common import EXIT_STOPPED_WITHOUT_REDIS

pytestmark = pytest.mark.slow  # a Redis of its own, stopped

MAX_MODEL_LEN = 16384
STOP_S = 5.0  # the worker's SPOOL_STOP_TIMEOUT_S here
BOUND_S = STOP_S + 15.0  # its exit, after the SIGTERM: the stop's bound and Celery's own teardown


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-endless"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )
    make_eos_unreachable(path)
    return path


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.close()


@pytest.fixture
def worker_and_api(
    redis_server: RedisServer, prefixes: Prefixes, endless_model: Path, log_dir: Path
) -> Iterator[tuple[Service, Service]]:
    prefix = prefixes.new()
    settings: dict[str, Any] = {
        "redis_url": redis_server.url,
        **SHORT_LEASES,
        "max_model_len": MAX_MODEL_LEN,
        "stop_timeout_s": STOP_S,
    }
    worker = start_worker(prefix, endless_model, log_dir, name="w", **settings)
    api = start_api(
        prefix, log_dir, redis_url=redis_server.url, model=endless_model, max_tokens_cap=MAX_MODEL_LEN
    )
    yield worker, api
    api.stop()
    worker.stop()


def test_a_worker_stopped_while_redis_is_down_exits_within_a_bound(
    worker_and_api: tuple[Service, Service], redis_server: RedisServer, figures: dict[str, Any]
) -> None:
    worker, api = worker_and_api
    # A job that runs for long: the worker holds it (a task thread, the engine, the writer).
    body = {"prompt": "once upon a time", "max_tokens": MAX_MODEL_LEN - 100, "temperature": 0}
    with httpx.Client(timeout=10) as client:
        r = client.post(f"{api.url}/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        job = f"{api.url}/v1/jobs/{r.json()['id']}"
        wait_until(lambda: client.get(job).json()["text"], "the job running", 60, (worker,))
    redis_server.stop(signal.SIGKILL)  # unreachable: connections refused from now on
    worker.handle.signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        status = worker.proc.wait(BOUND_S)
    except Exception:
        pytest.fail(f"the worker had not exited {BOUND_S} s after SIGTERM:\n{worker.log_tail()}")
    took = time.monotonic() - sent
    assert status == EXIT_STOPPED_WITHOUT_REDIS, (status, worker.log_tail())
    assert f"exiting with status {EXIT_STOPPED_WITHOUT_REDIS}" in worker.log(), worker.log_tail()
    figures["stop_without_redis_exit_s"] = round(took, 1)
    figures["stop_without_redis_status"] = status
