"""End to end: real uvicorn, real celery worker, real Redis, the tiny model, HTTP from outside.

The reference for every greedy job is transformers' own ``model.generate`` on the same
checkpoint, run alone, decoded here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from greedy import greedy
from procs import Cluster, Prefixes, Service, start_api, start_worker, wait_until
from sse_client import Event, check_full_stream, iter_sse, read_events

TERMINAL = {"succeeded", "failed", "cancelled", "partial"}
COLLECTED_AT = time.time()  # before the session's cluster starts (it starts with the first test using it)
Reference = Callable[[str, int], str]


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Reference:
    return lambda prompt, max_tokens: greedy(tiny_model, prompt, max_tokens).text


def submit(client: httpx.Client, url: str, prompt: str, max_tokens: int, **params: Any) -> dict[str, Any]:
    r = client.post(
        f"{url}/v1/jobs", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **params}
    )
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def wait_finished(client: httpx.Client, url: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def finished() -> bool:
        job.update(client.get(f"{url}/v1/jobs/{job_id}").json())
        return job["status"] in TERMINAL

    wait_until(finished, f"job {job_id} to finish", timeout)
    return job


def test_poll_to_completion_equals_greedy_reference(
    cluster: Cluster, client: httpx.Client, reference: Reference
) -> None:
    job = submit(client, cluster.url, "the quick brown fox", 40)
    assert job["status"] == "queued"
    job = wait_finished(client, cluster.url, job["id"])
    assert job["status"] == "succeeded", job
    assert job["text"] == reference("the quick brown fox", 40)
    assert job["finish_reason"] in ("stop", "length")
    assert job["usage"]["completion_tokens"] > 0
    assert job["usage"]["total_tokens"] == job["usage"]["prompt_tokens"] + job["usage"]["completion_tokens"]
    assert job["started_at"] >= job["created_at"] and job["finished_at"] >= job["started_at"]


def test_sse_stream_is_the_job(cluster: Cluster, client: httpx.Client, reference: Reference) -> None:
    job = submit(client, cluster.url, "Once upon a time", 48)
    events = read_events(client, f"{cluster.url}/v1/jobs/{job['id']}/events")
    assert check_full_stream(events) == reference("Once upon a time", 48)
    done = events[-1]
    assert done.event == "done" and done.data["status"] == "succeeded"
    final = client.get(f"{cluster.url}/v1/jobs/{job['id']}").json()
    assert final["text"] == reference("Once upon a time", 48)
    assert done.data["usage"] == final["usage"]


def test_streamed_submit_is_the_job_and_resumes_by_id(
    cluster: Cluster, client: httpx.Client, reference: Reference
) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}
    with client.stream("POST", f"{cluster.url}/v1/jobs", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        location = r.headers["location"]
        head = list(itertools.islice((e for e in iter_sse(r) if isinstance(e, Event)), 5))  # then it drops
    assert [e.id for e in head] == [1, 2, 3, 4, 5]
    rest = read_events(client, f"{cluster.url}{location}/events", last_event_id=5)
    assert check_full_stream(head + rest) == reference("Once upon a time", 48)
    assert client.get(f"{cluster.url}{location}").json()["text"] == reference("Once upon a time", 48)


def test_background_false_answers_with_the_result(
    cluster: Cluster, client: httpx.Client, reference: Reference
) -> None:
    r = client.post(
        f"{cluster.url}/v1/jobs",
        json={"prompt": "hello world", "max_tokens": 16, "temperature": 0, "background": False},
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "succeeded" and r.json()["text"] == reference("hello world", 16)


def test_32_concurrent_jobs_are_batched(cluster: Cluster, reference: Reference) -> None:
    prompts = [f"story number {i} begins with" for i in range(32)]
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(32) as pool:
        jobs = list(pool.map(lambda p: submit(client, cluster.url, p, 48), prompts))
        finals = list(pool.map(lambda j: wait_finished(client, cluster.url, j["id"], 120), jobs))
        ready = client.get(f"{cluster.url}/readyz").json()
    for prompt, job in zip(prompts, finals, strict=True):
        assert job["status"] == "succeeded", job
        assert job["text"] == reference(prompt, 48), prompt  # batching never changes greedy output
    [worker] = ready["workers"]
    assert worker["engine"]["peak_batch_size"] > 1


def test_readyz_lists_the_worker(cluster: Cluster, client: httpx.Client) -> None:
    body = client.get(f"{cluster.url}/readyz").json()
    [worker] = body["workers"]
    assert worker["name"] == f"{cluster.prefix}-w1"
    assert COLLECTED_AT < worker["ts"] <= time.time()  # a heartbeat of this run, in seconds since the epoch
    assert {"running", "waiting", "peak_batch_size"} <= set(worker["engine"])
    metrics = client.get(f"{cluster.url}/metrics").text
    assert "spool_workers 1.0" in metrics and "spool_jobs_submitted_total" in metrics
    assert f'spool_engine_slots{{worker="{worker["name"]}"}} 32.0' in metrics  # max_batch_size
    assert f'spool_engine_generated_tokens_total{{worker="{worker["name"]}"}}' in metrics  # a counter
    assert f'spool_engine_prefix_cache_hits_total{{worker="{worker["name"]}"}}' in metrics


@pytest.fixture(scope="module")
def one_slot(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Service]:
    """A worker with a single engine slot and its API: a second job runs only in a freed slot."""
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=1)
    api = start_api(prefix, log_dir)
    yield api
    api.stop()
    worker.stop()


def test_cancel_running_job_frees_its_slot(
    one_slot: Service, client: httpx.Client, reference: Reference
) -> None:
    url = one_slot.url
    long_job = submit(client, url, "the quick brown fox", 400)  # greedy: no EOS within 400 tokens
    waiting = submit(client, url, "hello world", 16)
    events: list[Event] = []
    with client.stream("GET", f"{url}/v1/jobs/{long_job['id']}/events") as r:
        for item in iter_sse(r):
            if isinstance(item, Event):
                events.append(item)
                if len(events) == 3:
                    cancelled = client.post(f"{url}/v1/jobs/{long_job['id']}/cancel")
                    assert cancelled.status_code == 200 and cancelled.json()["status"] in (
                        "running",
                        "cancelled",
                    )
    check_full_stream(events)
    assert events[-1].event == "done" and events[-1].data["finish_reason"] == "cancelled"
    assert len(events) < 400
    job = wait_finished(client, url, long_job["id"])
    assert (job["status"], job["finish_reason"]) == ("cancelled", "cancelled")
    # The one slot is free again: the job queued behind the cancelled one completes.
    assert wait_finished(client, url, waiting["id"])["text"] == reference("hello world", 16)
    assert client.post(f"{url}/v1/jobs/{long_job['id']}/cancel").json()["status"] == "cancelled"  # idempotent


def test_readyz_follows_the_workers(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, client: httpx.Client
) -> None:
    prefix = prefixes.new()
    api = start_api(prefix, log_dir, ready=False)
    try:
        r = client.get(f"{api.url}/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        worker = start_worker(prefix, tiny_model, log_dir, heartbeat_ttl_s=2)
        wait_until(lambda: client.get(f"{api.url}/readyz").status_code == 200, "ready with a worker", 30)
        worker.stop()
        wait_until(lambda: client.get(f"{api.url}/readyz").status_code == 503, "not ready without one", 30)
    finally:
        api.stop()


@pytest.mark.slow  # compiles
def test_a_worker_with_the_compiled_forward_serves_the_same_tokens(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, client: httpx.Client, reference: Reference
) -> None:
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, compile=True)
    api = start_api(prefix, log_dir)
    try:
        assert "compiled the forward in" in worker.log_path.read_text()  # at load, before its first heartbeat
        jobs = [submit(client, api.url, p, 24) for p in ("the quick brown fox", "over the lazy dog " * 5)]
        for job, prompt in zip(jobs, ("the quick brown fox", "over the lazy dog " * 5), strict=True):
            done = wait_finished(client, api.url, job["id"])
            assert done["status"] == "succeeded" and done["text"] == reference(prompt, 24)
    finally:
        api.stop()
        worker.stop()
