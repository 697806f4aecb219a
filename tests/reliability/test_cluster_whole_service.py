"""A master of the job data's Redis Cluster killed under load through the whole service (issue 45):
two APIs, a text worker, a media worker and a hook worker on a cluster of three masters with a
replica each (tests/redis_cluster.py), text jobs and jobs with an image part, each with a webhook,
SSE streams, and a client that keeps submitting and polling on both APIs while the master dies
(SIGKILL) and its replica is promoted. What the client saw is printed (pytest -s) for
docs/reliability.md. Every job accepted ends, every stream ends with a terminal event, and every
job's ``job.completed`` webhook is delivered.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from procs import SPOOL, Prefixes, Service, spool_env, start, start_api, wait_until
from redis_cluster import ClusterStack, cluster_stack
from sse_client import Event, iter_sse

from common.webhooks import new_secret
from spool_cli import procs as harness
from spool_cli.procs import free_port

pytestmark = pytest.mark.slow  # a six-node cluster, five services

LEASE_S = 3.0
TEXT_JOBS = 12
IMAGE_JOBS = 4
MAX_TOKENS = 120
END_TIMEOUT_S = 300
HOOKS = {"webhook_secret": new_secret(), "webhook_allow_hosts": "127.0.0.1", "webhook_backoff_s": 0.5}


class Receiver:
    """Counts the webhook deliveries per (job, event type)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.got: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                event = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.got[(event["data"]["id"], event["type"])] += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def completed(self, job_id: str) -> int:
        with self.lock:
            return self.got[(job_id, "job.completed")]


@pytest.fixture
def whole(
    tmp_path_factory: pytest.TempPathFactory,
    prefixes: Prefixes,
    tiny_model: Path,
    tiny_image_model: Path,
    log_dir: Path,
) -> Iterator[tuple[ClusterStack, list[Service], Receiver]]:
    base = tmp_path_factory.mktemp("redis-cluster-whole")
    receiver = Receiver()
    with cluster_stack(
        base, prefixes.new(), tiny_model, log_dir, lease_s=LEASE_S, max_batch_size=16, replicas=1
    ) as stack:
        stack.settings.update(HOOKS)
        common = {**stack.settings, "heartbeat_s": 0.5, "lease_s": LEASE_S}
        extra = []
        for kind, settings in (("media", {"image_model": tiny_image_model}), ("hooks", {})):
            env = spool_env(stack.prefix, worker_name=f"{stack.prefix}-{kind}", **common, **settings)
            env["OMP_NUM_THREADS"] = "1"
            extra.append(start(f"{kind}-{stack.prefix}", [SPOOL, "worker", "--kind", kind], env, log_dir))
        key = stack.keys.worker
        for service, kind in zip(extra, ("media", "hooks"), strict=True):
            wait_until(
                lambda k=kind: bool(stack.data.exists(key(f"{stack.prefix}-{k}"))), kind, 120, (service,)
            )
        apis = [start_api(stack.prefix, log_dir, sse_ping_s=1, model=tiny_model, **common) for _ in range(2)]
        try:
            yield stack, apis, receiver
        finally:
            for service in [*apis, *extra]:
                service.stop()
            receiver.server.shutdown()


def follow(url: str, job_id: str, events: list[Event], deadline: float) -> None:
    """A client's stream of the job, resumed with Last-Event-ID whenever it drops."""
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            headers = {"Last-Event-ID": str(events[-1].id)} if events else {}
            try:
                with client.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers=headers) as r:
                    if r.status_code == 200:
                        for item in iter_sse(r):
                            if isinstance(item, Event):
                                events.append(item)
                                if item.terminal:
                                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # a client's back-off before it resumes


def body(receiver: Receiver, i: int, image: bool) -> dict[str, Any]:
    hook = {"webhook": f"http://127.0.0.1:{receiver.port}/hook"}
    if not image:
        return {"prompt": f"tale {i} of the cluster", "max_tokens": MAX_TOKENS, "temperature": 0, **hook}
    parts = [
        {"type": "text", "prompt": f"a picture {i}", "max_tokens": 8},
        {"type": "image", "prompt": f"a boat {i}", "size": "32x32", "steps": 2, "seed": i},
    ]
    return {"parts": parts, **hook}


@pytest.mark.timeout(900)
def test_a_masters_failover_through_the_whole_service(
    whole: tuple[ClusterStack, list[Service], Receiver],
) -> None:
    stack, apis, receiver = whole
    urls = [a.url for a in apis]
    accepted: list[str] = []
    with httpx.Client(timeout=60) as client:
        for i in range(TEXT_JOBS + IMAGE_JOBS):
            r = client.post(f"{urls[i % 2]}/v1/jobs", json=body(receiver, i, i >= TEXT_JOBS))
            assert r.status_code == 202, r.text
            accepted.append(r.json()["id"])
    deadline = time.monotonic() + END_TIMEOUT_S
    streams: dict[str, list[Event]] = {j: [] for j in accepted[:2]}
    followers = [
        threading.Thread(target=follow, args=(urls[k], j, e, deadline))
        for k, (j, e) in enumerate(streams.items())
    ]
    for t in followers:
        t.start()
    wait_until(lambda: all(len(e) >= 3 for e in streams.values()), "the streams' first tokens", 120)

    victim = int(stack.data.get_node_from_key(stack.keys.job(accepted[0])).port)
    replica = next(p for p, n in stack.nodes.nodes().items() if n.master == victim)
    killed_at = time.monotonic()
    os.kill(stack.nodes.proc_of(victim).pid, signal.SIGKILL)

    seen: Counter[str] = Counter()
    late: list[str] = []

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while time.monotonic() < killed_at + 30:
                url = urls[i % 2]
                i += 1
                try:
                    r = client.post(f"{url}/v1/jobs", json=body(receiver, 100 + i, i % 5 == 0))
                    seen[f"POST {r.status_code}"] += 1
                    if r.status_code == 202:
                        late.append(r.json()["id"])
                    for j in accepted[:4]:
                        seen[f"GET {client.get(f'{url}/v1/jobs/{j}').status_code}"] += 1
                except httpx.HTTPError as e:
                    seen[type(e).__name__] += 1
                time.sleep(0.25)

    loader = threading.Thread(target=load)
    loader.start()

    def promoted() -> bool:
        try:
            return replica in stack.nodes.masters() and stack.nodes.ok()
        except (redis.RedisError, harness.HarnessError):
            return False

    wait_until(promoted, "the replica's promotion", 60)
    promoted_s = time.monotonic() - killed_at
    loader.join()
    jobs = accepted + late
    ended: dict[str, dict[str, Any]] = {}
    with httpx.Client(timeout=60) as client:

        def all_ended() -> bool:
            for j in jobs:
                if j not in ended:
                    r = client.get(f"{urls[0]}/v1/jobs/{j}")
                    if r.status_code == 200 and r.json()["status"] not in ("queued", "running"):
                        ended[j] = r.json()
            return len(ended) == len(jobs)

        wait_until(all_ended, "every accepted job to end", END_TIMEOUT_S, (*stack.workers, *apis))
    ended_s = time.monotonic() - killed_at
    wait_until(lambda: all(receiver.completed(j) for j in jobs), "every job.completed webhook", 120)
    hooked_s = time.monotonic() - killed_at
    for t in followers:
        t.join()
    duplicates = sum(receiver.completed(j) - 1 for j in jobs)
    print(
        f"\npromoted {promoted_s:.1f}s after the kill; every job ended {ended_s:.1f}s after, every"
        f" job.completed delivered {hooked_s:.1f}s after; {len(accepted)} jobs before the kill, {len(late)}"
        f" accepted during the 30 s after it; outcome {Counter(j['status'] for j in ended.values())};"
        f" errors {Counter((j.get('error') or {}).get('type') for j in ended.values() if j['status'] != 'succeeded')};"
        f" completed webhooks duplicated {duplicates}; client saw {dict(seen)}; streams"
        f" {[(len(e), e[-1].event if e else None) for e in streams.values()]}"
    )
    for events in streams.values():
        assert [e.id for e in events] == list(range(1, len(events) + 1))
        assert events and events[-1].terminal
