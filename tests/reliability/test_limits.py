"""Backpressure, limits, cancellation at every stage, and API keys, on a one-slot worker.

The worker has one engine slot (and so 5 task threads: one per slot plus 4 spare); the API
queues at most 8 jobs. Every check counts what was stored and streamed, not only status codes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import Workers, poll
from procs import REDIS_URL, Prefixes, Service, start_api
from sse_client import Event, check_full_stream, iter_sse, read_events

from common.keys import Keys

MAX_QUEUED = 8
ENVELOPE = {"message", "type", "param", "code"}
PROMPTS = ["the quick brown fox", "once upon a time there", "a long way from home, the", "hello world"]
LONG = "the quick brown fox"  # greedy: no EOS within 400 tokens


@pytest.fixture(scope="module")
def one_slot(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[tuple[Workers, Service]]:
    workers = Workers(prefixes.new(), tiny_model, log_dir, {"max_batch_size": 1})
    workers.start("w")
    api = start_api(workers.prefix, log_dir, sse_ping_s=1, max_queued_jobs=MAX_QUEUED)
    yield workers, api
    api.stop()
    workers.stop_all()


@pytest.fixture(scope="module")
def r() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


def envelope(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE, body
    return body["error"]  # type: ignore[no-any-return]


def submit(client: httpx.Client, url: str, prompt: str = LONG, **body: Any) -> dict[str, Any]:
    r = client.post(f"{url}/v1/jobs", json={"prompt": prompt, "temperature": 0, **body})
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def wait_job(client: httpx.Client, url: str, job_id: str, timeout: float = 120) -> dict[str, Any]:
    def terminal() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"{url}/v1/jobs/{job_id}").json()
        return job if job["status"] not in ("queued", "running") else None

    return poll(terminal, f"job {job_id} to end", timeout)  # type: ignore[no-any-return]


def job_ids(r: redis.Redis, keys: Keys) -> set[str]:
    """Every job hash stored under the prefix."""
    found = r.scan_iter(keys.job("*"))
    return {k.split(":")[2] for k in found if k.count(":") == 2}


def test_flood_past_the_queue_limit(
    one_slot: tuple[Workers, Service],
    r: redis.Redis,
    client: httpx.Client,
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    workers, api = one_slot
    keys = Keys(workers.prefix)
    before = job_ids(r, keys)
    peak = [0]
    stop = threading.Event()

    def watch_queue() -> None:  # the limit must hold at every instant, not only at the end
        while not stop.is_set():
            peak[0] = max(peak[0], int(r.zcard(keys.queued_jobs(0))))

    watcher = threading.Thread(target=watch_queue)
    watcher.start()
    n = 60
    with httpx.Client(timeout=30) as c, ThreadPoolExecutor(12) as pool:
        body = {"max_tokens": 24, "temperature": 0}
        answers = list(
            pool.map(
                lambda i: c.post(f"{api.url}/v1/jobs", json={"prompt": PROMPTS[i % 4], **body}), range(n)
            )
        )
    stop.set()
    watcher.join()
    accepted = {a.json()["id"]: PROMPTS[i % 4] for i, a in enumerate(answers) if a.status_code == 202}
    refused = [a for a in answers if a.status_code != 202]
    for a in refused:
        assert envelope(a, 429)["code"] == "queue_full"
        assert int(a.headers["retry-after"]) > 0
    assert refused and len(accepted) + len(refused) == n
    assert peak[0] <= MAX_QUEUED
    # Nothing was stored for a refused request; every accepted job runs to its greedy text.
    assert job_ids(r, keys) - before == set(accepted)
    for job_id, prompt in accepted.items():
        job = wait_job(client, api.url, job_id)
        assert job["status"] == "succeeded" and job["text"] == greedy_reference(prompt, 24).text
        events = read_events(client, f"{api.url}/v1/jobs/{job_id}/events")
        assert check_full_stream(events) == job["text"]
    assert client.post(f"{api.url}/v1/jobs", json={"prompt": "p", "max_tokens": 2}).status_code == 202
    figures["flood_requests"] = n
    figures["flood_accepted_all_succeeded"] = len(accepted)
    figures["flood_refused_429"] = len(refused)
    figures["flood_peak_queued"] = f"{peak[0]} (limit {MAX_QUEUED})"


def test_request_limits(one_slot: tuple[Workers, Service], client: httpx.Client) -> None:
    _, api = one_slot
    # Above the cap and past the model's context: the error names the smaller limit, the model's.
    err = envelope(client.post(f"{api.url}/v1/jobs", json={"prompt": "p", "max_tokens": 5000}), 400)
    assert err["code"] == "context_length_exceeded" and "5000" in err["message"] and "512" in err["message"]
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    headers = {"content-type": "application/json"}
    assert envelope(client.post(f"{api.url}/v1/jobs", content=big, headers=headers), 413)["code"] == (
        "body_too_large"
    )
    # Longer than the model can take: the API counts the prompt's tokens with the tokenizer the
    # worker stored, and refuses it before a job exists (tests/test_context_length.py: every endpoint).
    long = {"prompt": "many words " * 400, "max_tokens": 16}
    err = envelope(client.post(f"{api.url}/v1/jobs", json=long), 400)
    assert err["code"] == "context_length_exceeded"
    assert "512" in err["message"] and "max_tokens 16" in err["message"]


def test_timeout_ends_the_job_and_frees_its_slot(
    one_slot: tuple[Workers, Service], client: httpx.Client, greedy_reference: Any
) -> None:
    _, api = one_slot
    # A third of what the same job takes here, so the deadline falls mid-generation.
    full = wait_job(client, api.url, submit(client, api.url, max_tokens=450)["id"])
    timeout = (full["finished_at"] - full["created_at"]) / 3
    slow = submit(client, api.url, max_tokens=450, timeout_s=timeout)
    behind = submit(client, api.url, "hello world", max_tokens=16)  # runs only once the slot is free
    events = read_events(client, f"{api.url}/v1/jobs/{slow['id']}/events")
    check_full_stream(events)
    assert events[-1].event == "error" and events[-1].data["type"] == "timeout"
    job = wait_job(client, api.url, slow["id"])
    assert (job["status"], job["finish_reason"]) == ("failed", "timeout")
    assert job["usage"]["completion_tokens"] < 450
    assert wait_job(client, api.url, behind["id"])["text"] == greedy_reference("hello world", 16).text
    assert envelope(client.post(f"{api.url}/v1/jobs/{slow['id']}/cancel"), 409)["code"] == "conflict"


def test_cancel_at_every_stage(
    one_slot: tuple[Workers, Service], r: redis.Redis, client: httpx.Client, figures: dict[str, Any]
) -> None:
    workers, api = one_slot
    keys = Keys(workers.prefix)
    url = api.url
    # Five blockers take the worker's five task threads; the sixth job stays queued in Redis.
    # They cannot end on their own while the queued job is checked (greedy on LONG: no EOS
    # within 400 tokens, and one slot runs them one after the other), so no task thread frees.
    blockers = [submit(client, url, max_tokens=400) for _ in range(5)]
    poll(lambda: r.zcard(keys.queued_jobs(0)) == 0, "the blockers taken by the worker", 60)
    queued = submit(client, url, max_tokens=8)
    assert client.get(f"{url}/v1/jobs/{queued['id']}").json()["status"] == "queued"
    for _ in range(2):  # twice: harmless
        got = client.post(f"{url}/v1/jobs/{queued['id']}/cancel")
        assert got.status_code == 200 and got.json()["status"] == "cancelled"
    [done] = read_events(client, f"{url}/v1/jobs/{queued['id']}/events")
    assert (done.id, done.event, done.data["finish_reason"]) == (1, "done", "cancelled")
    for b in blockers:  # running or waiting for the slot inside the worker
        assert client.post(f"{url}/v1/jobs/{b['id']}/cancel").status_code == 200
    for b in blockers:
        assert wait_job(client, url, b["id"])["status"] == "cancelled"

    # Running: cancel after a few tokens; the stream ends with its terminal event at the next step.
    running = submit(client, url, max_tokens=400)
    after = submit(client, url, "hello world", max_tokens=8)
    events: list[Event] = []
    with client.stream("GET", f"{url}/v1/jobs/{running['id']}/events") as resp:
        for item in iter_sse(resp):
            if isinstance(item, Event):
                events.append(item)
                if len(events) == 3:
                    assert client.post(f"{url}/v1/jobs/{running['id']}/cancel").status_code == 200
                    assert client.post(f"{url}/v1/jobs/{running['id']}/cancel").status_code == 200
    check_full_stream(events)
    assert events[-1].event == "done" and events[-1].data["status"] == "cancelled"
    assert len(events) < 400
    assert wait_job(client, url, running["id"])["status"] == "cancelled"
    assert wait_job(client, url, after["id"])["status"] == "succeeded"  # the slot was freed

    # Finished: 409, and the job is unchanged.
    assert envelope(client.post(f"{url}/v1/jobs/{after['id']}/cancel"), 409)["code"] == "conflict"
    assert client.get(f"{url}/v1/jobs/{after['id']}").json()["status"] == "succeeded"

    # The queued job never reached the engine: once its message was consumed (the Celery queue
    # is empty) it still has no attempt, no worker, no start, and one event.
    lists = keys.queue_lists(workers.queue)
    poll(lambda: sum(r.llen(q) for q in lists) == 0, "the cancelled job's message consumed", 60)
    h = r.hgetall(keys.job(queued["id"]))
    assert (h["attempt"], h.get("worker"), h.get("started_at")) == ("0", None, None)
    assert r.llen(keys.job_log(queued["id"])) == 1
    figures["cancel_stages_checked"] = "queued, running, twice, finished (409), failed (409), dead worker"


@pytest.fixture(scope="module")
def keyed_api(one_slot: tuple[Workers, Service], log_dir: Path) -> Iterator[Service]:
    workers, _ = one_slot
    api = start_api(workers.prefix, log_dir, api_keys="key-one,key-two")
    yield api
    api.stop()


def test_api_keys(keyed_api: Service, client: httpx.Client) -> None:
    url = keyed_api.url
    one, two = ({"Authorization": f"Bearer {k}"} for k in ("key-one", "key-two"))
    body = {"prompt": "hello", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
        err = envelope(client.post(f"{url}/v1/jobs", json=body, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    assert envelope(client.get(f"{url}/v1/models"), 401)["code"] == "invalid_api_key"
    assert client.get(f"{url}/healthz").status_code == 200  # probes stay open
    job = client.post(f"{url}/v1/jobs", json=body, headers=one).json()
    assert len(job["id"]) == 32 and int(job["id"], 16) >= 0  # 128 random bits
    unknown = client.get(f"{url}/v1/jobs/{'0' * 32}", headers=two)
    for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/events")):
        resp = client.request(method, f"{url}/v1/jobs/{job['id']}{path}", headers=two)
        assert envelope(resp, 404)["code"] == "job_not_found"  # the same answer as an unknown id
        assert resp.json()["error"]["type"] == unknown.json()["error"]["type"]
    assert client.get(f"{url}/v1/jobs/{job['id']}", headers=one).status_code == 200
    ids = {client.post(f"{url}/v1/jobs", json=body, headers=two).json()["id"] for _ in range(20)}
    assert len(ids) == 20
