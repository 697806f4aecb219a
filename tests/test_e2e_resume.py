"""Resuming a job's SSE stream: dropped at random points, on two API processes, during and after the job."""

from __future__ import annotations

import random

import httpx
from procs import Cluster, Service
from sse_client import Event, check_full_stream, read_events

PROMPT = "the quick brown fox"  # greedy on the tiny model: no EOS within 400 tokens
MAX_TOKENS = 400


def events_url(base: str, job_id: str) -> str:
    return f"{base}/v1/jobs/{job_id}/events"


def test_drop_and_resume_alternating_api_processes(
    cluster: Cluster, second_api: Service, client: httpx.Client
) -> None:
    rng = random.Random(20240601)
    r = client.post(
        f"{cluster.url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    )
    job_id = r.json()["id"]
    apis = (cluster.url, second_api.url)
    got: list[Event] = []
    connections = resumed_while_running = 0
    while not (got and got[-1].terminal):
        if got and client.get(f"{cluster.url}/v1/jobs/{job_id}").json()["status"] == "running":
            resumed_while_running += 1
        cursor = got[-1].id if got else None
        # Each connection goes to the other API process and is dropped after a random count.
        got += read_events(
            client,
            events_url(apis[connections % 2], job_id),
            last_event_id=cursor,
            stop_after=rng.randint(1, 20),
        )
        connections += 1
    assert connections > 20
    assert resumed_while_running > 0, "every resume came after the job ended; the job ran too fast to test"
    text = check_full_stream(got)  # no gap, no duplicate, one terminal event
    full = read_events(client, events_url(second_api.url, job_id))
    assert got == full
    assert client.get(f"{second_api.url}/v1/jobs/{job_id}").json()["text"] == text
    assert got[-1].data["usage"]["completion_tokens"] == MAX_TOKENS


def test_resume_after_the_job_ended_on_either_process(
    cluster: Cluster, second_api: Service, client: httpx.Client
) -> None:
    r = client.post(
        f"{cluster.url}/v1/jobs", json={"prompt": "hello world", "max_tokens": 32, "temperature": 0}
    )
    job_id = r.json()["id"]
    full = read_events(client, events_url(cluster.url, job_id))  # returns once the job ended
    check_full_stream(full)
    for k in random.Random(7).sample(range(len(full) + 1), 12) + [0, len(full)]:
        for api in (cluster.url, second_api.url):
            assert read_events(client, events_url(api, job_id), last_event_id=k) == full[k:]
            assert read_events(client, f"{events_url(api, job_id)}?after={k}") == full[k:]
