"""A worker whose clock runs 90 s ahead of the API's keeps the foreground requests whose clients
wait, and stores its jobs' times and webhook events on Redis's clock.

The worker runs under libfaketime (Debian's ``faketime``; the test skips without it). It cancels
a foreground job that nobody has watched for ``SPOOL_DETACH_GRACE_S``; the watchers' leases are
written by the API. Were they scored with the API's clock and read with the worker's, every
lease would look 90 s lapsed and the worker would cancel requests whose clients still read.
Were a job's ``started_at`` and ``finished_at`` the worker's clock, they would lie 90 s in the
future, and its webhook deliveries (due when recorded) would come due 90 s late.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from openai_stream import JOB_ID_HEADER, iter_chunks
from procs import (
    REDIS_URL,
    SPOOL,
    Prefixes,
    Service,
    finished_job,
    heartbeats,
    spool_env,
    start,
    start_api,
    wait_until,
)

from common.keys import Keys
from common.webhooks import new_secret
from workers.liveness import FIRST_WATCHER_S

SKEW = "+90s"
GRACE_S = 1.0
HEARTBEAT_S = 0.5
MAX_MODEL_LEN = 16384
ENDLESS: dict[str, Any] = {
    "prompt": "In the beginning",
    "max_tokens": 16000,
    "temperature": 0,
    "stream": True,
}

pytestmark = [
    pytest.mark.slow,  # a worker of its own under faketime
    pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian: faketime)"),
]


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-endless"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )
    make_eos_unreachable(path)
    return path


@pytest.fixture(scope="module")
def skewed(prefixes: Prefixes, endless_model: Path, log_dir: Path) -> Iterator[tuple[Service, Service]]:
    prefix = prefixes.new()
    env = spool_env(
        prefix,
        model=endless_model,
        worker_name=f"{prefix}-ahead",
        heartbeat_s=HEARTBEAT_S,
        detach_grace_s=GRACE_S,
        max_model_len=MAX_MODEL_LEN,
        max_batch_size=2,
    )
    env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"  # only the wall clock is off, as on a real machine
    worker = start(f"worker-{prefix}-ahead", ["faketime", "-f", SKEW, SPOOL, "worker"], env, log_dir)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(lambda: bool(heartbeats(r, Keys(prefix))), "the skewed worker's heartbeat", 120, (worker,))
    api = start_api(
        prefix,
        log_dir,
        detach_grace_s=GRACE_S,
        max_tokens_cap=MAX_MODEL_LEN,
        webhook_secret=new_secret(),
        webhook_allow_hosts="127.0.0.1",  # no hook worker runs: the deliveries stay due
    )
    yield worker, api
    api.stop()
    worker.stop()


def test_a_worker_ahead_keeps_a_foreground_stream_whose_client_reads(
    skewed: tuple[Service, Service], client: httpx.Client, redis_client: redis.Redis, figures: dict[str, Any]
) -> None:
    worker, api = skewed
    keys = Keys(api.prefix)
    [beat] = heartbeats(redis_client, keys)

    def worker_clock() -> float:
        return float(heartbeats(redis_client, keys)[0]["ts"])

    assert beat["ts"] > redis_client.time()[0] + 60  # the worker's clock is ahead
    with client.stream("POST", f"{api.url}/v1/completions", json=ENDLESS) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers[JOB_ID_HEADER]
        chunks = iter_chunks(r)
        # Read on until the worker has held the job past its first check and beaten thrice more
        # (its heartbeat's ts, on its own clock).
        checked_by = worker_clock() + max(GRACE_S, FIRST_WATCHER_S) + 3 * HEARTBEAT_S
        read = 0
        for chunk in chunks:
            assert not chunk.done, "the stream ended while its client read"
            read += 1
            if worker_clock() > checked_by:
                break
        status = redis_client.hget(keys.job(job_id), "status")
        assert status == b"running", status
        assert not redis_client.hget(keys.job(job_id), "cancel_requested")
    # The client hung up: now the job is cancelled, after the grace, as any abandoned one.
    job = finished_job(client, api.url, job_id)
    assert job["status"] == "cancelled"
    assert worker.alive()
    figures["clock_skew_worker_ahead"] = SKEW
    figures["clock_skew_tokens_read_before_check"] = read


def test_a_worker_ahead_stores_times_and_webhooks_on_redis_clock(
    skewed: tuple[Service, Service], client: httpx.Client, redis_client: redis.Redis, figures: dict[str, Any]
) -> None:
    _, api = skewed
    keys = Keys(api.prefix)
    before = redis_now(redis_client)
    body = {
        "prompt": "hello",
        "max_tokens": 3,
        "webhook": "http://127.0.0.1:9/hook",
        "webhook_events": ["start", "completed"],
    }
    submitted = client.post(f"{api.url}/v1/jobs", json=body)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    job = finished_job(client, api.url, job_id)
    after = redis_now(redis_client)
    assert job["status"] == "succeeded", job
    # Within Redis's clock around the job (a second's slack for rounding), not 90 s ahead.
    off = [job["started_at"] - after, job["finished_at"] - after]
    assert before - 1 <= job["started_at"] <= job["finished_at"] <= after + 1, (before, job, after)
    hooks = keys.hooks("job", job_id)
    due = redis_client.zscore(keys.hooks_due_of(hooks), hooks)
    assert due is not None and due <= after + 1, (due, after)  # due now, not 90 s from now
    created = [
        json.loads(v)["created_at"] for f, v in redis_client.hgetall(hooks).items() if f.startswith(b"d")
    ]
    assert len(created) == 2 and all(before - 1 <= c <= after + 1 for c in created), (created, before, after)
    figures["clock_skew_stored_times_ahead_of_redis_s"] = round(max(off), 3)
    figures["clock_skew_webhook_due_ahead_of_redis_s"] = round(due - after, 3)


def redis_now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6
