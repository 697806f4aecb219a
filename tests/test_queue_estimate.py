"""A queued job's ``estimated_start_s`` with a real worker: positive behind others once its
model's jobs have a measured service time, null once no worker of its model is live (its
``queue_position`` still says it waits); ``spool job`` says both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import redis
from procs import REDIS_URL, SPOOL, Prefixes, finished_job, start_api, start_worker, wait_until

from common.keys import Keys
from common.store.service_times import estimate_start_s

LONG = {"prompt": "once upon a time", "max_tokens": 480, "min_tokens": 480, "temperature": 0}  # ~the context
LEASES = {"heartbeat_ttl_s": 3, "lease_s": 3}


def submit(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    r = client.post(f"{url}/v1/jobs", json=body)
    assert r.status_code in (200, 201, 202), r.text
    return str(r.json()["id"])


def spool_job(url: str, job_id: str) -> tuple[dict[str, Any], str]:
    done = subprocess.run([SPOOL, "job", job_id, "--url", url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_the_estimate_is_positive_behind_others_and_null_without_a_live_worker(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, client: httpx.Client
) -> None:
    prefix = prefixes.new()
    r, keys = redis.Redis.from_url(REDIS_URL, decode_responses=True), Keys(prefix)
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=1, **LEASES)
    api = start_api(prefix, log_dir)
    try:
        # One job ends: the model's first service time.
        first = submit(client, api.url, {"prompt": "x", "max_tokens": 16, "temperature": 0})
        assert finished_job(client, api.url, first)["status"] == "succeeded"
        samples = keys.service_times(keys.model_queue(tiny_model.name))
        wait_until(lambda: r.llen(samples) == 1, "the first job's service time", 30)
        # One slot: long jobs fill it and the worker's spare task threads; the last ones wait.
        ids = [submit(client, api.url, LONG) for _ in range(10)]
        last = client.get(f"{api.url}/v1/jobs/{ids[-1]}").json()
        assert last["status"] == "queued"
        assert last["queue_position"] >= 1
        assert last["estimated_start_s"] > 0
        shown, said = spool_job(api.url, ids[-1])
        if shown["status"] == "queued":  # (the CLI starts slowly: it may have been taken meanwhile)
            assert shown["estimated_start_s"] > 0
            assert "ahead of it; expected to start in about" in said

        # No worker of its model (killed: a stop would run the queued jobs first): still
        # waiting, with no basis for an estimate.
        os.killpg(worker.proc.pid, signal.SIGKILL)
        wait_until(lambda: not r.exists(keys.worker(f"{prefix}-w1")), "the worker's heartbeat gone", 30)
        waiting = client.get(f"{api.url}/v1/jobs/{ids[-1]}").json()
        assert waiting["status"] == "queued"
        assert isinstance(waiting["queue_position"], int)
        assert waiting["estimated_start_s"] is None
        shown, said = spool_job(api.url, ids[-1])
        assert (shown["status"], shown["estimated_start_s"]) == ("queued", None)
        assert "ahead of it; no start estimate (no live worker of its model" in said
    finally:
        api.stop()
        worker.stop()


def test_the_estimate_counts_the_slot_ends_before_the_job() -> None:
    assert estimate_start_s(0, slots=4, held=2, service_s=10.0) == 0  # a slot is free for it
    assert estimate_start_s(0, slots=4, held=4, service_s=10.0) == 2.5  # the first of 4 slots to free
    assert estimate_start_s(3, slots=4, held=4, service_s=10.0) == 10.0  # 4 ends: one round of slots
    assert estimate_start_s(5, slots=1, held=1, service_s=2.0) == 12.0
    assert estimate_start_s(3, slots=4, held=4, service_s=None) is None  # none of its jobs ended yet
    assert estimate_start_s(3, slots=0, held=0, service_s=10.0) is None
