"""A hanging webhook receiver and a healthy one on the same host, different ports (issue 45, 2).

One real hook worker (`spool worker --kind hooks`) and API of their own; no text worker: each job
ends by its cancel, which records its job.completed delivery. The hanging receiver takes many
deliveries (more than the hook worker's task threads) and never answers within the test; the
healthy one's delivery lag, from the cancel's answer to the POST's arrival, must stay within a
second of what it was with the hook worker idle. Before the fix the in-flight cap was per host
name (both receivers shared it) and waiters held task threads: the healthy one got nothing.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from operator import contains
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from procs import REDIS_URL, SPOOL, Prefixes, Service, spool_env, start, start_api, wait_until

from common.keys import Keys
from spool_cli.procs import free_port

pytestmark = pytest.mark.slow

MAX_PER_DESTINATION = 2
HANGING = 24  # deliveries to the hanging receiver: more than a hook worker's 16 task threads
SAMPLES = 5  # healthy deliveries timed, idle and then beside the hanging receiver
LAG_TIMEOUT_S = 30.0  # a delivery not there by then counts as lost (the test fails)
SETTINGS: dict[str, object] = {
    "webhook_allow_private": True,
    "webhook_max_per_host": MAX_PER_DESTINATION,
    "webhook_timeout_s": 120,  # a held delivery stays held for the whole test
    "webhook_backoff_s": 0.3,
    "webhook_sweep_s": 0.1,
}


@dataclass
class Receiver:
    """Records when each job's event arrived; with ``hang``, holds every request until released."""

    hang: bool
    port: int = field(default_factory=free_port)
    arrived: dict[str, float] = field(default_factory=dict)  # job id -> time.monotonic()
    holding: int = 0
    most_held: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def serve(self) -> ThreadingHTTPServer:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                job_id = str(json.loads(body)["data"]["id"])
                with receiver.lock:
                    receiver.arrived.setdefault(job_id, time.monotonic())
                    receiver.holding += 1
                    receiver.most_held = max(receiver.most_held, receiver.holding)
                if receiver.hang:
                    receiver.release.wait(300)
                with receiver.lock:
                    receiver.holding -= 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.fixture(scope="module")
def hook_stack(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    prefix, name = prefixes.new(), "dest-h1"
    env = spool_env(prefix, worker_name=name, heartbeat_s=0.5, **SETTINGS)
    worker = start(f"hooks-{prefix}-{name}", [SPOOL, "worker", "--kind", "hooks"], env, log_dir)
    api = start_api(prefix, log_dir, ready=False, **SETTINGS)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(lambda: bool(r.exists(Keys(prefix).worker(name))), f"{worker.name} heartbeat", 60, (worker,))
    yield api
    api.stop()
    worker.stop()


def ended_job(client: httpx.Client, api: Service, url: str) -> tuple[str, float]:
    """A job with ``url`` as its webhook, cancelled: its id and when the cancel answered."""
    created = client.post(f"{api.url}/v1/jobs", json={"prompt": "x", "webhook": url})
    assert created.status_code == 202, created.text
    job_id = str(created.json()["id"])
    cancelled = client.post(f"{api.url}/v1/jobs/{job_id}/cancel")
    assert cancelled.json()["status"] == "cancelled", cancelled.text
    return job_id, time.monotonic()


def lags(client: httpx.Client, api: Service, healthy: Receiver) -> list[float]:
    """SAMPLES deliveries to the healthy receiver, one after another: each one's lag."""
    out = []
    for _ in range(SAMPLES):
        job_id, ended = ended_job(client, api, healthy.url())
        wait_until(
            partial(contains, healthy.arrived, job_id), "the healthy receiver's delivery", LAG_TIMEOUT_S
        )
        out.append(healthy.arrived[job_id] - ended)
    return out


def test_a_hanging_receiver_does_not_delay_another_port_of_its_host(
    client: httpx.Client, hook_stack: Service, figures: dict[str, Any]
) -> None:
    hanging, healthy = Receiver(hang=True), Receiver(hang=False)
    servers = [hanging.serve(), healthy.serve()]
    try:
        idle = lags(client, hook_stack, healthy)
        held = [ended_job(client, hook_stack, hanging.url())[0] for _ in range(HANGING)]
        wait_until(lambda: hanging.holding == MAX_PER_DESTINATION, "the hanging receiver's slots taken", 30)
        busy = lags(client, hook_stack, healthy)
        figures["a hanging webhook receiver beside a healthy one on the same host (lag, s)"] = (
            f"idle max {max(idle):.2f} (median {statistics.median(idle):.2f}); beside "
            f"{HANGING} held deliveries max {max(busy):.2f} (median {statistics.median(busy):.2f})"
        )
        print(f"idle lags {[round(x, 3) for x in idle]}, busy lags {[round(x, 3) for x in busy]}")
        assert max(busy) <= max(idle) + 1.0, (idle, busy)
        assert hanging.most_held == MAX_PER_DESTINATION  # its own cap still holds it
        hanging.release.set()
        wait_until(lambda: set(held) <= set(hanging.arrived), "every held delivery, once released", 60)
    finally:
        hanging.release.set()
        for server in servers:
            server.shutdown()
