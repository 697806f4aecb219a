"""/readyz counts the workers that run jobs: a hook worker alone (it delivers webhooks and runs
no job) leaves the API not ready, a text worker beside it makes it ready."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis
from procs import (
    REDIS_URL,
    SPOOL,
    START_TIMEOUT_S,
    Prefixes,
    heartbeats,
    spool_env,
    start,
    start_api,
    start_worker,
    wait_until,
)

from common.keys import Keys


def test_a_hook_worker_alone_is_not_ready(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> None:
    prefix = prefixes.new()
    api = start_api(prefix, log_dir, ready=False)
    env = spool_env(prefix, heartbeat_s=0.5, worker_name=f"{prefix}-hooks")
    hooks = start(f"hooks-{prefix}", [SPOOL, "worker", "--kind", "hooks"], env, log_dir)
    r = redis.Redis.from_url(REDIS_URL)
    try:
        wait_until(
            lambda: bool(heartbeats(r, Keys(prefix))),
            "the hook worker's heartbeat",
            START_TIMEOUT_S,
            (hooks,),
        )
        answer = httpx.get(f"{api.url}/readyz", timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "no_worker"
        worker = start_worker(prefix, tiny_model, log_dir)
        try:
            answer = httpx.get(f"{api.url}/readyz", timeout=30)
            assert answer.status_code == 200, answer.text
            assert {w["kind"] for w in answer.json()["workers"]} == {"text", "hooks"}
        finally:
            worker.stop()
    finally:
        hooks.stop()
        api.stop()
        r.close()
