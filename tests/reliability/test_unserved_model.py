"""Jobs queued for a model that no live worker serves (issue 45, 1).

Two models' workers beat and leave (stand-in heartbeats, removed: as far as Redis can tell they
were served and are gone), the first in order before the other. With no worker live, a job that
names no model is queued for the model served last (not the first in order), and one names the
other; ``GET /v1/jobs/{id}`` says why each waits. Then a worker of a third model starts: once
``SPOOL_UNSERVED_GRACE_S`` passed since the gone models' last beats, its sweep moves the job that
named no model to its own queue (it runs there) and fails the one that named its model with
``model_not_served``; an embedding job that named no model it leaves for a worker whose model
embeds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from breakers import SHORT_LEASES
from procs import REDIS_URL, Prefixes, Service, finished_job, start_api, start_worker

from common.schemas.views import WorkerHeartbeat
from common.settings import Settings
from common.store import SyncJobStore

pytestmark = pytest.mark.slow  # a worker of its own

GRACE_S = 3.0
FIRST, LAST = "aaa-left-first", "zzz-left-last"  # the gone models, in order and in time


@pytest.fixture
def store(prefixes: Prefixes) -> Iterator[SyncJobStore]:
    s = SyncJobStore.from_settings(Settings(redis_url=REDIS_URL, redis_prefix=prefixes.new()))
    yield s
    s.close()


@pytest.fixture
def api(store: SyncJobStore, log_dir: Path) -> Iterator[Service]:
    api = start_api(store.settings.redis_prefix, log_dir, ready=False, unserved_grace_s=GRACE_S)
    yield api
    api.stop()


def left(store: SyncJobStore, model: str) -> None:
    """A worker of ``model`` beat and left: the model counts as served within the hour."""
    store.beat(WorkerHeartbeat(name=f"{model}-w", ts=time.time(), engine={}, model=model))
    store.remove_heartbeat(f"{model}-w")


def submit(client: httpx.Client, api: Service, **extra: Any) -> str:
    r = client.post(
        f"{api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 3, "temperature": 0, **extra}
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_jobs_of_a_model_nobody_serves_are_reported_then_moved_or_failed(
    store: SyncJobStore,
    api: Service,
    client: httpx.Client,
    tiny_model: Path,
    log_dir: Path,
    figures: dict[str, Any],
) -> None:
    left(store, FIRST)
    left(store, LAST)
    unnamed = submit(client, api)
    named = submit(client, api, model=FIRST)
    r = client.post(f"{api.url}/v1/jobs", json={"embed": {"input": ["hello"]}})  # an embedding job
    assert r.status_code == 202, r.text
    embedding = r.json()["id"]
    waiting = {j: client.get(f"{api.url}/v1/jobs/{j}").json() for j in (unnamed, named)}
    assert all(w["status"] == "queued" for w in waiting.values()), waiting
    reason = waiting[unnamed]["waiting_reason"]
    assert reason is not None and repr(LAST) in reason and "moves to a model" in reason, reason
    reason = waiting[named]["waiting_reason"]
    assert reason is not None and repr(FIRST) in reason and "model_not_served" in reason, reason

    prefix = store.settings.redis_prefix
    worker = start_worker(prefix, tiny_model, log_dir, name="live", unserved_grace_s=GRACE_S, **SHORT_LEASES)
    started = time.monotonic()
    try:
        moved = finished_job(client, api.url, unnamed, timeout=60)
        moved_s = time.monotonic() - started
        failed = finished_job(client, api.url, named, timeout=60)
        failed_s = time.monotonic() - started
        fresh = finished_job(client, api.url, submit(client, api), timeout=60)  # a live model now
    finally:
        worker.stop()
    assert moved["status"] == "succeeded" and moved["model"] == tiny_model.name, moved  # its directory's name
    assert failed["status"] == "failed" and failed["error"]["type"] == "model_not_served", failed
    assert FIRST in failed["error"]["message"], failed
    assert fresh["status"] == "succeeded", fresh
    # The pass that moved the unnamed job looked at this one too: a generating worker leaves it.
    assert client.get(f"{api.url}/v1/jobs/{embedding}").json()["status"] == "queued"
    figures["unserved_moved_after_worker_start_s"] = round(moved_s, 1)
    figures["unserved_failed_after_worker_start_s"] = round(failed_s, 1)
