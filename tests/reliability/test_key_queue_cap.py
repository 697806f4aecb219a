"""One key cannot take the whole queue (issue #45, defect 5).

SPOOL_MAX_QUEUED_JOBS (1,000) was the only bound: one key got 1,109 jobs in and another key's
trickle then waited (one request 49.1 s). Now with API keys each key has at most
SPOOL_MAX_QUEUED_JOBS_PER_KEY jobs queued (SPOOL_TENANT_MAX_QUEUED_JOBS for some keys), counted in
the create script with the job (create.lua), so a flood from one key answers that key 429 and
leaves the rest of the queue to the others. No worker runs: every accepted job stays queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Prefixes, Service, start_api
from pydantic import ValidationError

from api.auth import owner_of
from common.settings import Settings
from common.tenants import tenant_of

FLOOD, CALM, GENEROUS = "key-flood", "key-calm", "key-generous"
GLOBAL_CAP, KEY_CAP, GENEROUS_CAP = 40, 10, 20
FLOOD_REQUESTS = 60


@pytest.fixture(scope="module")
def api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    service = start_api(
        prefixes.new(),
        log_dir,
        ready=False,
        api_keys=f"{FLOOD},{CALM},{GENEROUS}",
        max_queued_jobs=GLOBAL_CAP,
        max_queued_jobs_per_key=KEY_CAP,
        tenant_max_queued_jobs=f"{tenant_of(owner_of(GENEROUS))}={GENEROUS_CAP}",
    )
    yield service
    service.stop()


PLAIN = {"prompt": "hello", "max_tokens": 2}
WITH_PARTS = {"parts": [{"type": "text", "prompt": "hi", "max_tokens": 2}]}  # create_parts.lua's


def submit(api: Service, key: str, body: dict[str, Any] = PLAIN) -> httpx.Response:
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        return c.post("/v1/jobs", json=body)


def test_one_keys_flood_is_refused_to_it_alone(api: Service, figures: dict[str, Any]) -> None:
    with ThreadPoolExecutor(16) as pool:
        flood = list(pool.map(lambda _: submit(api, FLOOD), range(FLOOD_REQUESTS)))
    statuses = [r.status_code for r in flood]
    assert statuses.count(202) == KEY_CAP, statuses
    assert statuses.count(429) == FLOOD_REQUESTS - KEY_CAP, statuses
    refusal = next(r for r in flood if r.status_code == 429)
    assert refusal.json()["error"]["code"] == "queue_full"
    assert "SPOOL_MAX_QUEUED_JOBS_PER_KEY" in refusal.json()["error"]["message"]
    assert refusal.headers["retry-after"]
    parts = submit(api, FLOOD, WITH_PARTS)
    assert parts.status_code == 429, parts.text
    assert "SPOOL_MAX_QUEUED_JOBS_PER_KEY" in parts.json()["error"]["message"]

    # The other keys' room is theirs: a key with its own cap gets exactly that, another its own.
    generous = [submit(api, GENEROUS).status_code for _ in range(GENEROUS_CAP + 1)]
    assert generous == [202] * GENEROUS_CAP + [429], generous
    calm = [submit(api, CALM, body).status_code for body in [PLAIN] * 4 + [WITH_PARTS]]
    assert calm == [202] * 5, calm
    figures["key_queue_cap"] = {
        "flood": f"{statuses.count(202)} x 202, {statuses.count(429)} x 429",
        "other_key": f"{calm.count(202)} x 202",
    }

    # A job of the flooding key that leaves the queue (here: cancelled) frees its room.
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {FLOOD}"}, timeout=30) as c:
        job_id = next(r for r in flood if r.status_code == 202).json()["id"]
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert submit(api, FLOOD).status_code == 202
    assert submit(api, FLOOD).status_code == 429


@pytest.mark.parametrize("value", ["3f2a9c01b7de=0", "3f2a9c01b7de=x", "3f2a9c01b7de"])
def test_a_tenant_cap_that_is_not_a_count_is_refused(value: str) -> None:
    with pytest.raises(ValidationError, match="tenant_max_queued_jobs"):
        Settings(tenant_max_queued_jobs=value)
    assert Settings(tenant_max_queued_jobs="3f2a9c01b7de=7").max_queued_of("3f2a9c01b7de") == 7
    assert Settings(max_queued_jobs_per_key=9).max_queued_of("other") == 9
