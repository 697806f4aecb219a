"""Tenants take turns in a model's queue: a job of one API key is taken before another key's
backlog, queued ahead of it, has drained (common/keys.py TENANT_QUEUES).

One worker of one slot (so 1 + SPARE_TASK_THREADS task threads) and one API with two keys. The
worker is frozen while "flood" queues a backlog and then "trickle" one job, so that all of them
wait in the queue together; first come, first served it would take the trickle job last.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import Prefixes, Service, start_api, start_worker, wait_until

from api.auth import owner_of
from common.keys import Keys
from common.settings import DEFAULT_SERVED_MODEL
from common.tenants import tenant_of
from workers.celery_app import SPARE_TASK_THREADS

pytestmark = pytest.mark.slow  # a worker and an API of its own

BACKLOG = 30
SLOTS = 1
TASK_THREADS = SLOTS + SPARE_TASK_THREADS  # the most messages the worker holds at a time
CANDIDATE_KEYS = [f"test-key-{i}" for i in range(16)]


def tenant_list(key: str) -> str:
    return Keys.tenant_queue(Keys().model_queue(DEFAULT_SERVED_MODEL), tenant_of(owner_of(key)))


def two_keys_apart() -> tuple[str, str]:
    """Two API keys whose tenants hash to different tenant queues (two that share one still
    queue first come, first served between them)."""
    flood = CANDIDATE_KEYS[0]
    trickle = next(k for k in CANDIDATE_KEYS[1:] if tenant_list(k) != tenant_list(flood))
    return flood, trickle


@pytest.fixture
def stack(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[tuple[Service, Service]]:
    prefix = prefixes.new()
    keys = {"api_keys": ",".join(two_keys_apart())}
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=SLOTS, **keys)
    api = start_api(prefix, log_dir, max_queued_jobs=4 * BACKLOG, **keys)
    yield worker, api
    api.stop()
    worker.stop()


def test_a_tenants_job_is_taken_before_another_tenants_backlog_drains(
    stack: tuple[Service, Service],
) -> None:
    worker, api = stack
    flood, trickle = two_keys_apart()
    body = {"prompt": "the quick brown fox", "max_tokens": 8, "min_tokens": 8, "background": True}

    def post(client: httpx.Client, key: str) -> str:
        r = client.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json=body)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    with httpx.Client(base_url=api.url, timeout=30) as client:
        # Frozen for less than a heartbeat TTL: the worker stays live, and everything queued
        # meanwhile waits in the queue together (a pop already sent may take the first message).
        os.killpg(worker.proc.pid, signal.SIGSTOP)
        try:
            backlog = [post(client, flood) for _ in range(BACKLOG)]
            mine = post(client, trickle)
        finally:
            os.killpg(worker.proc.pid, signal.SIGCONT)

        def job(job_id: str, key: str) -> dict[str, object]:
            r = client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return dict(r.json())

        ended = lambda: all(job(j, flood)["status"] == "succeeded" for j in backlog)  # noqa: E731
        wait_until(lambda: job(mine, trickle)["status"] == "succeeded" and ended(), "every job to end", 120)
        at = float(str(job(mine, trickle)["started_at"]))  # taken by the worker (take.lua)
        ahead = sum(1 for j in backlog if float(str(job(j, flood)["started_at"])) < at)
    # First come, first served: all BACKLOG ahead of it. Round robin between the tenant queues:
    # at most the messages the worker held when it took the trickle job's.
    assert ahead <= TASK_THREADS, f"{ahead} of the {BACKLOG} backlog jobs were taken before it"
