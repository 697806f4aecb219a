"""Webhooks end to end: a real API, text worker and two hook workers (`spool worker --kind hooks`)
on a prefix of their own, and a real receiver (an HTTP server on 127.0.0.1, allowed by
SPOOL_WEBHOOK_ALLOW_HOSTS; `localhost` stays refused, so the private-address guard is tested too).
The per-host bound has an API and hook worker of its own (``bounded``), with receivers on
127.0.0.1 and 127.0.0.2 as two hosts.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import standardwebhooks
from procs import (
    REDIS_URL,
    SPOOL,
    START_TIMEOUT_S,
    Prefixes,
    Service,
    finished_job,
    heartbeats,
    spool_env,
    start,
    start_api,
    start_worker,
    wait_until,
)
from prom import scrape

from common.keys import Keys
from common.webhooks import new_secret
from spool_cli.procs import free_port

SECRET, OLD_SECRET = new_secret(), new_secret()
HOOK_SETTINGS = {
    "webhook_secret": f"{SECRET},{OLD_SECRET}",  # a rotation: both sign
    "webhook_backoff_s": 0.3,
    "webhook_timeout_s": 2,
    "webhook_sweep_s": 0.1,
}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        return dict(json.loads(self.body))


@dataclass
class Receiver:
    """Answers each path with the next of its scripted codes (then the last one again)."""

    port: int
    host: str = "127.0.0.1"
    received: list[Received] = field(default_factory=list)
    scripts: dict[str, list[int]] = field(default_factory=dict)
    hold: threading.Event = field(default_factory=threading.Event)  # /hold waits for it
    lock: threading.Lock = field(default_factory=threading.Lock)
    holding: int = 0  # /hold requests waiting now
    most_held: int = 0  # the most that waited at once

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def answer(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        with self.lock:
            self.received.append(Received(path, headers, body))
            codes = self.scripts.get(path, [200])
            return codes.pop(0) if len(codes) > 1 else codes[0]


def serve(receiver: Receiver) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/hold":
                receiver.answer(self.path, body, dict(self.headers))
                with receiver.lock:
                    receiver.holding += 1
                    receiver.most_held = max(receiver.most_held, receiver.holding)
                receiver.hold.wait(60)
                with receiver.lock:
                    receiver.holding -= 1
                code = 200
            else:
                code = receiver.answer(self.path, body, dict(self.headers))
            self.send_response(code)
            if code == 302:
                self.send_header("Location", receiver.url("/ok").replace("127.0.0.1", "localhost"))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((receiver.host, receiver.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Hooks:
    prefix: str
    api: Service
    workers: list[Service]
    receiver: Receiver
    start_hook_worker: Callable[[str], Service]
    metrics_url: str  # the first hook worker's

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)


@pytest.fixture(scope="module")
def hooks(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Hooks]:
    prefix, metrics_port = prefixes.new(), free_port()
    receiver = Receiver(free_port())
    server = serve(receiver)
    r = redis.Redis.from_url(REDIS_URL)

    def launch(name: str, **settings: object) -> Service:
        named = {"worker_name": f"{prefix}-{name}", "webhook_allow_hosts": "127.0.0.1"}
        env = spool_env(prefix, heartbeat_s=0.5, **named, **HOOK_SETTINGS, **settings)
        return start(f"hooks-{prefix}-{name}", [SPOOL, "worker", "--kind", "hooks"], env, log_dir)

    def beats(pid: int) -> bool:
        return any(b.get("pid") == pid for b in heartbeats(r, Keys(prefix)))

    def beating(*workers: Service) -> None:
        for worker in workers:
            wait_until(
                partial(beats, worker.proc.pid),
                f"{worker.name} heartbeat",
                START_TIMEOUT_S,
                (worker,),
            )

    def start_hook_worker(name: str) -> Service:
        worker = launch(name)
        beating(worker)
        return worker

    # They start while the text worker loads its model.
    workers = [launch("h1", worker_metrics_port=metrics_port), launch("h2")]
    text = start_worker(prefix, tiny_model, log_dir, max_batch_size=32)
    # The API also lets 127.0.0.2 through, which the hook workers refuse when they connect.
    api = start_api(
        prefix, log_dir, batch_feed_s=0.1, webhook_allow_hosts="127.0.0.1,127.0.0.2", **HOOK_SETTINGS
    )
    beating(*workers)
    yield Hooks(prefix, api, workers, receiver, start_hook_worker, f"http://127.0.0.1:{metrics_port}/metrics")
    for s in [api, *workers, text]:
        s.stop()
    server.shutdown()


def submit(client: httpx.Client, hooks: Hooks, path: str, **extra: Any) -> str:
    body = {"prompt": "hello", "max_tokens": 3, "webhook": hooks.receiver.url(path), **extra}
    response = client.post(f"{hooks.api.url}/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def deliveries(client: httpx.Client, hooks: Hooks, job_id: str) -> list[dict[str, Any]]:
    response = client.get(f"{hooks.api.url}/v1/jobs/{job_id}/webhooks")
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def delivery(client: httpx.Client, hooks: Hooks, job_id: str, index: int = 0) -> dict[str, Any]:
    """One of the job's deliveries; {} while it has none (its event is not recorded yet)."""
    listed = deliveries(client, hooks, job_id)
    return listed[index] if listed else {"status": None, "attempts": []}


def of_job(received: list[Received], job_id: str) -> list[Received]:
    return [r for r in received if r.event["data"]["id"] == job_id]


def test_events_are_signed_in_order_and_verify(client: httpx.Client, hooks: Hooks) -> None:
    job_id = submit(client, hooks, "/ok", webhook_events=["completed", "start"])
    wait_until(lambda: len(of_job(hooks.receiver.at("/ok"), job_id)) >= 2, "started and completed", 30)
    started, completed = of_job(hooks.receiver.at("/ok"), job_id)[:2]
    assert [started.event["type"], completed.event["type"]] == ["job.started", "job.completed"]
    job = client.get(f"{hooks.api.url}/v1/jobs/{job_id}").json()
    assert completed.event["data"]["status"] == "succeeded"
    assert completed.event["data"]["text"] == job["text"]
    assert completed.headers["webhook-id"] == completed.event["id"]
    assert len(completed.headers["webhook-signature"].split()) == 2  # one per secret of the rotation
    for secret in (SECRET, OLD_SECRET):
        assert (
            standardwebhooks.Webhook(secret).verify(completed.body, completed.headers)["id"]
            == completed.event["id"]
        )
    unwrapped = openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(
        completed.body, completed.headers
    )
    assert unwrapped.id == completed.event["id"]  # type: ignore[union-attr]
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(new_secret()).verify(completed.body, completed.headers)
    listed = deliveries(client, hooks, job_id)
    assert [(d["type"], d["status"], len(d["attempts"])) for d in listed] == [
        ("job.started", "delivered", 1),
        ("job.completed", "delivered", 1),
    ]
    assert listed[1]["attempts"][0]["status_code"] == 200
    secrets = client.get(f"{hooks.api.url}/v1/webhook_secret").json()["secrets"]
    assert secrets == [SECRET, OLD_SECRET]


def test_500_twice_then_200_three_attempts_same_id_growing_delays(client: httpx.Client, hooks: Hooks) -> None:
    hooks.receiver.scripts["/flaky"] = [500, 500, 200]
    job_id = submit(client, hooks, "/flaky")
    wait_until(lambda: delivery(client, hooks, job_id, 0)["status"] == "delivered", "delivered", 30)
    got = of_job(hooks.receiver.at("/flaky"), job_id)
    assert len(got) == 3
    assert len({r.headers["webhook-id"] for r in got}) == 1
    assert len({r.body for r in got}) == 1
    [d] = deliveries(client, hooks, job_id)
    assert [a["status_code"] for a in d["attempts"]] == [500, 500, 200]
    delays = [a["next_attempt_at"] - a["at"] for a in d["attempts"][:2]]
    assert delays[0] < delays[1]  # the backoff's schedule, as recorded (not the clock's)


def test_a_receiver_down_for_several_retries_gets_the_event_once_back(
    client: httpx.Client, hooks: Hooks
) -> None:
    down = Receiver(free_port())  # nothing listens on its port yet
    body = {"prompt": "hello", "max_tokens": 3, "webhook": down.url("/later")}
    job_id = client.post(f"{hooks.api.url}/v1/jobs", json=body).json()["id"]
    wait_until(lambda: len(delivery(client, hooks, job_id)["attempts"]) >= 4, "4 failed attempts", 60)
    assert all(
        a["error"] and a["status_code"] is None for a in deliveries(client, hooks, job_id)[0]["attempts"]
    )
    server = serve(down)
    try:
        wait_until(lambda: delivery(client, hooks, job_id, 0)["status"] == "delivered", "delivered", 60)
        assert [r.event["type"] for r in down.at("/later")] == ["job.completed"]
    finally:
        server.shutdown()


def test_410_disables_the_url_for_the_key(client: httpx.Client, hooks: Hooks) -> None:
    hooks.receiver.scripts["/gone"] = [410]
    first = submit(client, hooks, "/gone")
    wait_until(lambda: delivery(client, hooks, first, 0)["status"] == "disabled", "disabled", 30)
    second = submit(client, hooks, "/gone")
    wait_until(lambda: delivery(client, hooks, second, 0)["status"] == "disabled", "second disabled", 30)
    assert deliveries(client, hooks, second)[0]["attempts"] == []
    assert len(hooks.receiver.at("/gone")) == 1
    # A retry enables the URL again.
    hooks.receiver.scripts["/gone"] = [200]
    response = client.post(f"{hooks.api.url}/v1/jobs/{second}/webhooks/whd_1/retry")
    assert response.status_code == 200, response.text
    wait_until(lambda: delivery(client, hooks, second, -1)["status"] == "delivered", "redelivered", 30)
    assert deliveries(client, hooks, second)[-1]["retry_of"] == "whd_1"


def test_private_destinations_are_refused(client: httpx.Client, hooks: Hooks) -> None:
    port = hooks.receiver.port
    for url in (
        f"http://localhost:{port}/ok",  # a name that resolves to 127.0.0.1
        "http://10.1.2.3/",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]:9/",
        "http://224.0.0.1/",
    ):
        response = client.post(f"{hooks.api.url}/v1/jobs", json={"prompt": "x", "webhook": url})
        assert response.status_code == 400, (url, response.text)
        assert response.json()["error"]["param"] == "webhook"
    for body in (
        {"webhook": "ftp://example.com/"},
        {"webhook": "http://user:pw@example.com/"},
        {"webhook": hooks.receiver.url("/ok"), "webhook_events": ["finished"]},
        {"webhook_events": ["completed"]},
    ):
        response = client.post(f"{hooks.api.url}/v1/jobs", json={"prompt": "x", **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == "invalid_webhook"
    response = client.post(
        f"{hooks.api.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "webhook": f"http://localhost:{port}/"},
    )
    assert response.status_code == 400, response.text


def test_the_address_is_checked_again_at_connect(client: httpx.Client, hooks: Hooks) -> None:
    url = f"http://127.0.0.2:{hooks.receiver.port}/rebound"  # the API's allow-list has it, the workers' not
    response = client.post(f"{hooks.api.url}/v1/jobs", json={"prompt": "x", "max_tokens": 2, "webhook": url})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    # A refusal by the guard is permanent: one attempt, recorded, never retried.
    wait_until(lambda: delivery(client, hooks, job_id)["status"] == "failed", "the delivery to fail", 30)
    [refused] = deliveries(client, hooks, job_id)
    assert refused["next_attempt_at"] is None
    [attempt] = refused["attempts"]
    assert "127.0.0.2" in attempt["error"] and "loopback" in attempt["error"], attempt
    assert hooks.receiver.at("/rebound") == []


def test_parts_send_their_status_changes_in_order(client: httpx.Client, hooks: Hooks) -> None:
    parts = [
        {"type": "text", "prompt": "a", "max_tokens": 2},
        {"type": "text", "prompt": "b", "max_tokens": 2},
    ]
    body = {"parts": parts, "webhook": hooks.receiver.url("/parts"), "webhook_events": ["part", "completed"]}
    response = client.post(f"{hooks.api.url}/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    wait_until(
        lambda: any(r.event["type"] == "job.completed" for r in of_job(hooks.receiver.at("/parts"), job_id)),
        "job.completed",
        30,
    )
    events = [r.event for r in of_job(hooks.receiver.at("/parts"), job_id)]
    # Each part: running, then succeeded; data.part says which.
    assert [e["type"] for e in events] == ["job.part"] * 4 + ["job.completed"]
    assert sorted(e["data"]["part"] for e in events[:4]) == [0, 0, 1, 1]
    assert events[-1]["data"]["status"] == "succeeded"
    assert [int(e["id"].rsplit("_", 1)[1]) for e in events] == [1, 2, 3, 4, 5]  # in the order recorded


def test_spool_generate_and_batch_take_a_webhook(hooks: Hooks, tmp_path: Path) -> None:
    run = [
        SPOOL,
        "generate",
        "hi",
        "--max-tokens",
        "2",
        "--url",
        hooks.api.url,
        "--webhook",
        hooks.receiver.url("/cli"),
    ]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    run = [SPOOL, "batch", str(src), "--url", hooks.api.url, "--webhook", hooks.receiver.url("/cli")]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    wait_until(
        lambda: {r.event["type"] for r in hooks.receiver.at("/cli")} == {"job.completed", "batch.completed"},
        "the CLI's webhooks",
        30,
    )


def test_a_redirect_is_not_followed(client: httpx.Client, hooks: Hooks) -> None:
    hooks.receiver.scripts["/redirect"] = [302]
    before = len(hooks.receiver.at("/ok"))
    job_id = submit(client, hooks, "/redirect")
    wait_until(lambda: len(delivery(client, hooks, job_id)["attempts"]) >= 2, "two attempts", 30)
    assert {a["status_code"] for a in deliveries(client, hooks, job_id)[0]["attempts"]} == {302}
    assert deliveries(client, hooks, job_id)[0]["status"] == "pending"
    assert len(hooks.receiver.at("/ok")) == before


def test_openai_routes_take_a_webhook(client: httpx.Client, hooks: Hooks) -> None:
    response = client.post(
        f"{hooks.api.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "webhook": hooks.receiver.url("/oai")},
    )
    assert response.status_code == 200, response.text
    job_id = response.headers["X-Spool-Job-Id"]
    wait_until(lambda: bool(of_job(hooks.receiver.at("/oai"), job_id)), "the completion's webhook", 30)


def test_a_response_sends_its_end_as_openai_names_it(client: httpx.Client, hooks: Hooks) -> None:
    url = f"{hooks.api.url}/v1/responses"
    bad = client.post(
        url, json={"input": "hi", "webhook": hooks.receiver.url("/r"), "webhook_events": ["start"]}
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "invalid_webhook"
    ends = {}
    for path, body in (
        ("/r-length", {"max_output_tokens": 2}),  # cut at its limit: incomplete
        ("/r-cancel", {"max_output_tokens": 400}),
    ):
        created = client.post(
            url, json={"input": "hi", "background": True, "webhook": hooks.receiver.url(path), **body}
        )
        assert created.status_code == 200, created.text
        ends[path] = created.json()["id"], created.headers["X-Spool-Job-Id"]
    cancelled = client.post(f"{url}/{ends['/r-cancel'][0]}/cancel")
    assert cancelled.json()["status"] == "cancelled", cancelled.text
    unwrap = openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap
    for path, expected in (("/r-length", "incomplete"), ("/r-cancel", "cancelled")):
        resp_id, job_id = ends[path]
        wait_until(lambda p=path: bool(hooks.receiver.at(p)), f"{path}'s webhook", 30)  # type: ignore[misc]
        [got] = hooks.receiver.at(path)
        event = unwrap(got.body, got.headers)
        assert client.get(f"{url}/{resp_id}").json()["status"] == expected
        assert event.type == f"response.{expected}"
        assert event.data.id == resp_id  # type: ignore[union-attr]
        assert got.event["data"] == {"id": resp_id}  # OpenAI's webhook data for a response
        assert [d["type"] for d in deliveries(client, hooks, job_id)] == [f"response.{expected}"]


def test_a_keys_endpoints_receive_every_jobs_events_until_deleted(client: httpx.Client, hooks: Hooks) -> None:
    url = f"{hooks.api.url}/v1/webhook_endpoints"
    for bad in (
        {"url": f"http://localhost:{hooks.receiver.port}/"},
        {"url": hooks.receiver.url("/endpoint"), "events": ["finished"]},
        {"url": hooks.receiver.url("/endpoint"), "events": []},
    ):
        response = client.post(url, json=bad)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["code"] == "invalid_webhook"
    created = client.post(
        url, json={"url": hooks.receiver.url("/endpoint"), "events": ["start", "completed"]}
    )
    assert created.status_code == 200, created.text
    endpoint = created.json()
    try:
        assert client.get(url).json()["data"] == [endpoint]
        plain = client.post(f"{hooks.api.url}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
        own = submit(client, hooks, "/own")  # its own webhook too: each gets its events
        wait_until(
            lambda: (
                len(of_job(hooks.receiver.at("/endpoint"), plain)) == 2
                and len(of_job(hooks.receiver.at("/endpoint"), own)) == 2
                and len(of_job(hooks.receiver.at("/own"), own)) == 1
            ),
            "the endpoint's and the job's own deliveries",
            30,
        )
        assert [r.event["type"] for r in of_job(hooks.receiver.at("/endpoint"), plain)] == [
            "job.started",
            "job.completed",
        ]
        assert [r.event["type"] for r in of_job(hooks.receiver.at("/own"), own)] == ["job.completed"]
        assert {d["url"] for d in deliveries(client, hooks, own)} == {
            hooks.receiver.url("/own"),
            hooks.receiver.url("/endpoint"),
        }
    finally:
        deleted = client.delete(f"{url}/{endpoint['id']}")
    assert deleted.json()["deleted"] is True, deleted.text
    assert client.get(url).json()["data"] == []
    assert client.delete(f"{url}/{endpoint['id']}").status_code == 404
    after = client.post(f"{hooks.api.url}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
    finished_job(client, hooks.api.url, after)
    assert deliveries(client, hooks, after) == []  # recorded with its end, had there been one


def test_a_batch_sends_batch_completed(client: httpx.Client, hooks: Hooks) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 2},
        }
        for i in range(3)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = client.post(
        f"{hooks.api.url}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    ).json()
    batch = {"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    for bad in (
        {"webhook": f"http://localhost:{hooks.receiver.port}/"},
        {"webhook": hooks.receiver.url("/batch"), "webhook_events": ["started"]},
        {"webhook_events": ["completed"]},
    ):
        response = client.post(f"{hooks.api.url}/v1/batches", json={**batch, **bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["code"] == "invalid_webhook"
    created = client.post(
        f"{hooks.api.url}/v1/batches", json={**batch, "webhook": hooks.receiver.url("/batch")}
    )
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    wait_until(lambda: bool(hooks.receiver.at("/batch")), "batch.completed", 60)
    [got] = hooks.receiver.at("/batch")
    assert got.event["type"] == "batch.completed"
    assert got.event["data"]["id"] == batch_id
    assert got.event["data"]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    listed = client.get(f"{hooks.api.url}/v1/batches/{batch_id}/webhooks").json()["data"]
    assert [d["status"] for d in listed] == ["delivered"]


def test_many_jobs_every_completed_delivered(client: httpx.Client, hooks: Hooks) -> None:
    ids = {submit(client, hooks, "/many", max_tokens=2) for _ in range(500)}

    def delivered() -> set[str]:
        return {r.event["data"]["id"] for r in hooks.receiver.at("/many")}

    wait_until(lambda: delivered() >= ids, "every job's job.completed", 120)
    by_id: dict[str, set[str]] = {}
    for r in hooks.receiver.at("/many"):
        by_id.setdefault(r.event["data"]["id"], set()).add(r.headers["webhook-id"])
    assert all(len(events) == 1 for events in by_id.values())  # one event per job (retries share its id)
    worker = scrape(hooks.metrics_url)
    assert worker[("spool_webhook_deliveries_total", frozenset({("outcome", "delivered")}))] > 0
    assert worker[("spool_webhook_attempt_seconds_count", frozenset())] > 0
    api = scrape(f"{hooks.api.url}/metrics")
    assert ("spool_webhook_backlog", frozenset()) in api


@pytest.mark.slow  # hook workers killed
def test_sigkill_of_the_delivering_worker_loses_nothing(client: httpx.Client, hooks: Hooks) -> None:
    job_id = submit(client, hooks, "/hold")
    wait_until(lambda: bool(hooks.receiver.at("/hold")), "the delivery held open", 30)
    # Every hook worker is killed, so the one holding the delivery is: which one holds it, a
    # heartbeat on a loaded machine does not tell reliably (it can be a beat behind).
    for worker in hooks.workers:
        worker.handle.signal(signal.SIGKILL)
        worker.proc.wait(10)
    hooks.workers.clear()
    hooks.receiver.hold.set()  # the next attempt is answered
    hooks.workers.append(hooks.start_hook_worker("h3"))
    wait_until(
        lambda: delivery(client, hooks, job_id, 0)["status"] == "delivered", "delivered after the kill", 60
    )
    held = hooks.receiver.at("/hold")
    assert {h.headers["webhook-id"] for h in held} == {held[0].headers["webhook-id"]}
    assert len(held) == 2  # the attempt cut off, and the one that delivered


MAX_PER_HOST = 2


@pytest.fixture(scope="module")
def bounded(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    """An API and one hook worker of their own, private addresses allowed, MAX_PER_HOST deliveries
    in flight per host, a long timeout (a held delivery stays held); no text worker: the jobs end
    by their cancel, which records their job.completed."""
    prefix, name = prefixes.new(), "bounded-h1"
    settings = {
        **HOOK_SETTINGS,
        "webhook_allow_private": True,
        "webhook_max_per_host": MAX_PER_HOST,
        "webhook_timeout_s": 60,
    }
    env = spool_env(prefix, worker_name=name, heartbeat_s=0.5, **settings)
    worker = start(f"hooks-{prefix}-{name}", [SPOOL, "worker", "--kind", "hooks"], env, log_dir)
    api = start_api(prefix, log_dir, ready=False, **settings)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(lambda: bool(r.exists(Keys(prefix).worker(name))), f"{worker.name} heartbeat", 60, (worker,))
    yield api
    api.stop()
    worker.stop()


def test_a_slow_host_holds_at_most_max_per_host_while_another_host_gets_its_own(
    client: httpx.Client, bounded: Service
) -> None:
    slow, other = Receiver(free_port()), Receiver(free_port(), host="127.0.0.2")
    servers = [serve(slow), serve(other)]

    def ended_job(url: str) -> str:
        created = client.post(f"{bounded.url}/v1/jobs", json={"prompt": "x", "webhook": url})
        assert created.status_code == 202, created.text
        job_id = str(created.json()["id"])
        cancelled = client.post(f"{bounded.url}/v1/jobs/{job_id}/cancel")
        assert cancelled.json()["status"] == "cancelled", cancelled.text
        return job_id

    def listed(job_id: str) -> dict[str, Any]:
        [d] = client.get(f"{bounded.url}/v1/jobs/{job_id}/webhooks").json()["data"]
        return dict(d)

    try:
        held = [ended_job(slow.url("/hold")) for _ in range(MAX_PER_HOST + 2)]
        wait_until(lambda: slow.holding == MAX_PER_HOST, "the slow host's deliveries in flight", 30)
        other_id = ended_job(other.url("/ok"))
        wait_until(lambda: bool(other.at("/ok")), "the other host's delivery, past the slow one", 30)
        assert other.at("/ok")[0].event["data"]["id"] == other_id
        # The slow host's other deliveries wait for a slot.
        assert len(slow.at("/hold")) == MAX_PER_HOST
        assert all(listed(j)["status"] == "pending" for j in held)
        slow.hold.set()
        wait_until(lambda: all(listed(j)["status"] == "delivered" for j in held), "every slow delivery", 60)
        assert slow.most_held == MAX_PER_HOST
        assert all(len(listed(j)["attempts"]) == 1 for j in held)  # a wait for a slot is no attempt
    finally:
        slow.hold.set()
        for server in servers:
            server.shutdown()
