"""The webhook address guard against IPv6 forms that embed an IPv4 address (issue #45, defect 3).

Python 3.11 calls ``::127.0.0.1``, ``64:ff9b::169.254.169.254`` (NAT64), ``2002:7f00:1::`` (6to4)
and ``fec0::1`` (site-local) global, so they passed the guard at submit (job 202, endpoint 200).
The guard has an explicit deny list now (common/webhooks.py ``address_refused``), used at submit
and at each attempt; an attempt the guard refuses is a permanent failure, recorded at once,
never retried (it was retried for SPOOL_WEBHOOK_HORIZON_S, 24 h).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from procs import (
    REDIS_URL,
    SPOOL,
    START_TIMEOUT_S,
    Prefixes,
    Service,
    heartbeats,
    spool_env,
    start,
    start_api,
    wait_until,
)

from common.keys import Keys
from common.webhooks import address_refused

pytestmark = pytest.mark.slow

# Each embeds a loopback, link-local (cloud metadata) or private IPv4 address, or is site-local.
DISGUISED = [
    "::127.0.0.1",
    "64:ff9b::127.0.0.1",
    "64:ff9b::169.254.169.254",
    "2002:7f00:1::",
    "2002:a9fe:a9fe::",
    "fec0::1",
    "64:ff9b:1::a00:1",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "::ffff:169.254.169.254",
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "::ffff:0:7f00:1",  # IPv4-translated 127.0.0.1
]
# The same forms around a global IPv4 address stay allowed (an IPv6-only network's DNS64 answers
# 64:ff9b::a.b.c.d for an IPv4-only receiver).
GLOBAL = ["64:ff9b::8.8.8.8", "2002:808:808::1", "::ffff:8.8.8.8", "2606:4700:4700::1111"]


@dataclass
class Stack:
    strict: Service  # the default guard
    lax: Service  # SPOOL_WEBHOOK_ALLOW_PRIVATE: lets anything through at submit


@pytest.fixture(scope="module")
def stack(prefixes: Prefixes, log_dir: Path) -> Iterator[Stack]:
    prefix = prefixes.new()
    settings: dict[str, Any] = {"webhook_backoff_s": 0.3, "webhook_timeout_s": 2, "webhook_sweep_s": 0.1}
    env = spool_env(prefix, heartbeat_s=0.5, worker_name=f"{prefix}-h1", **settings)
    hook_worker = start(f"hooks-{prefix}-h1", [SPOOL, "worker", "--kind", "hooks"], env, log_dir)
    strict = start_api(prefix, log_dir, ready=False, **settings)
    lax = start_api(prefix, log_dir, ready=False, webhook_allow_private=True, **settings)
    r = redis.Redis.from_url(REDIS_URL)
    pid = hook_worker.proc.pid
    wait_until(
        lambda: any(b.get("pid") == pid for b in heartbeats(r, Keys(prefix))),
        "the hook worker's heartbeat",
        START_TIMEOUT_S,
        (hook_worker,),
    )
    yield Stack(strict, lax)
    for s in (strict, lax, hook_worker):
        s.stop()


@pytest.mark.parametrize("address", DISGUISED)
def test_embedded_private_addresses_are_refused_at_submit(stack: Stack, address: str) -> None:
    url = f"http://[{address}]:8080/hook"
    with httpx.Client(base_url=stack.strict.url, timeout=30) as client:
        job = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2, "webhook": url})
        assert job.status_code == 400, job.text
        assert job.json()["error"]["code"] == "invalid_webhook"
        endpoint = client.post("/v1/webhook_endpoints", json={"url": url})
        assert endpoint.status_code == 400, endpoint.text
        assert endpoint.json()["error"]["code"] == "invalid_webhook"
    assert address_refused(address)  # the check the hook workers make at each attempt


@pytest.mark.parametrize("address", GLOBAL)
def test_the_same_forms_around_a_global_address_are_allowed(address: str) -> None:
    assert not address_refused(address)


def test_an_attempt_the_guard_refuses_fails_at_once_and_is_not_retried(stack: Stack) -> None:
    url = "http://[64:ff9b::127.0.0.1]:9/refused"  # taken by the lax API, refused by the hook worker
    with httpx.Client(base_url=stack.lax.url, timeout=30) as client:
        r = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2, "webhook": url})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200  # job.completed: cancelled

        def listed() -> list[dict[str, Any]]:
            return list(client.get(f"/v1/jobs/{job_id}/webhooks").json()["data"])

        wait_until(lambda: bool(listed()) and listed()[0]["status"] != "pending", "the delivery to end", 30)
        [delivery] = listed()
        assert delivery["status"] == "failed", delivery
        assert delivery["next_attempt_at"] is None
        [attempt] = delivery["attempts"]
        assert attempt["status_code"] is None and "loopback" in attempt["error"]
