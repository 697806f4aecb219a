"""The broker on a Redis of its own (SPOOL_BROKER_URL) and the job data on another (SPOOL_REDIS_URL).

Two private redis-servers: a job, a stream resumed from its last id, a batch, a job taken over
after its worker's SIGKILL and a job submitted while the broker is down all end as with one
Redis; the data Redis never holds a Celery key, the broker never a job's, and the outbox the
scripts write messages to (common/store/outbox.py) is empty once they ran.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from breakers import SHORT_LEASES, JobWatch, RedisServer, Stream, Workers, poll
from procs import Prefixes, Service, start_api
from sse_client import check_full_stream, read_events

from common.keys import Keys
from spool_cli.procs import delete_prefixes

pytestmark = pytest.mark.slow  # private redis-servers, a broker stopped, a worker killed

PROMPT = "the quick brown fox"  # greedy on the tiny model: no EOS within 400 tokens


@dataclass
class Apart:
    broker: RedisServer
    data: RedisServer
    workers: Workers
    api: Service

    @property
    def keys(self) -> Keys:
        return Keys(self.workers.prefix)

    def check_roles(self) -> None:
        """Celery's keys on the broker only, the job data's on the data Redis only."""
        prefix = self.workers.prefix
        data_keys = set(self.data.client.scan_iter(count=1000))
        broker_keys = set(self.broker.client.scan_iter(count=1000))
        celery = [k for k in data_keys if k.startswith((f"{prefix}.", "_kombu"))]
        assert not celery, f"Celery keys on the data Redis: {sorted(celery)[:10]}"
        jobs = [k for k in broker_keys if k.startswith(f"{prefix}:")]
        assert not jobs, f"job keys on the broker's Redis: {sorted(jobs)[:10]}"
        assert any(k.startswith("_kombu.binding") for k in broker_keys), sorted(broker_keys)
        assert any(k.startswith(f"{prefix}:job:") for k in data_keys)
        poll(lambda: self.data.client.llen(self.keys.outbox(0)) == 0, "the outbox relayed", 30)


@pytest.fixture(scope="module")
def apart(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Apart]:
    broker = RedisServer(tmp_path_factory.mktemp("broker"))
    data = RedisServer(tmp_path_factory.mktemp("data"))
    broker.start()
    data.start()
    urls = {"redis_url": data.url, "broker_url": broker.url}
    # A job here is taken once more after the kill: SPOOL_MAX_ATTEMPTS leaves room for it.
    settings = {**urls, **SHORT_LEASES, "max_batch_size": 8, "max_attempts": 5}
    workers = Workers(prefixes.new(), tiny_model, log_dir, settings)
    workers.start("a")
    workers.start("b")
    api = start_api(workers.prefix, log_dir, sse_ping_s=1, batch_feed_s=0.1, batch_window=4, **urls)
    yield Apart(broker, data, workers, api)
    api.stop()
    workers.stop_all()
    delete_prefixes(data.client, [workers.prefix])
    broker.close()
    data.close()


def submit(client: httpx.Client, url: str, max_tokens: int) -> str:
    r = client.post(f"{url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_a_job_streamed_and_resumed(apart: Apart, client: httpx.Client, greedy_reference: Any) -> None:
    url = apart.api.url
    job_id = submit(client, url, 40)
    events = read_events(client, f"{url}/v1/jobs/{job_id}/events", stop_after=5)
    events += read_events(client, f"{url}/v1/jobs/{job_id}/events", last_event_id=events[-1].id)
    assert check_full_stream(events) == greedy_reference(PROMPT, 40).text
    job = client.get(f"{url}/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["text"] == greedy_reference(PROMPT, 40).text
    apart.check_roles()


def test_a_batch(apart: Apart) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"{PROMPT} {i}", "max_tokens": 6, "temperature": 0},
        }
        for i in range(10)
    ]
    with openai.OpenAI(base_url=f"{apart.api.url}/v1", api_key="unused", max_retries=0) as oai:
        content = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = oai.files.create(file=("in.jsonl", content), purpose="batch").id
        batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        done = poll(
            lambda: (b := oai.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
            "the batch to end",
            120,
        )
        assert done.status == "completed" and done.request_counts.completed == len(lines), done
        assert done.output_file_id is not None
        out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    assert all(x["response"]["status_code"] == 200 for x in out)
    apart.check_roles()


def test_a_killed_workers_job_is_taken_over(
    apart: Apart, client: httpx.Client, greedy_reference: Any
) -> None:
    url, workers = apart.api.url, apart.workers
    poll(lambda: all(s.alive() for s in workers.procs.values()), "every worker up", 120)
    job_id = submit(client, url, 300)
    stream = Stream(f"{url}/v1/jobs/{job_id}/events")
    watch = JobWatch(apart.data.client, apart.keys, job_id)
    poll(lambda: watch.tokens() >= 20, "20 tokens", 60)
    holder = workers.by_full_name(watch.field("worker"))
    workers.kill(holder, signal.SIGKILL)
    assert watch.field("status") == "running", "the job ended before its worker was killed"
    # The sweep of the other worker requeues it through the broker (Celery's send_task).
    poll(lambda: int(watch.field("attempt") or 0) >= 2, "a take-over", 60)
    events = stream.join(120)
    assert check_full_stream(events) == greedy_reference(PROMPT, 300).text
    assert events[-1].data["status"] == "succeeded"
    workers.start(holder)
    apart.check_roles()


def test_a_job_sent_while_the_broker_is_down_runs_once_it_is_back(apart: Apart, client: httpx.Client) -> None:
    """The job is stored and answered 202; its message waits in the outbox and a worker's sweep
    relays it when the broker is back."""
    url = apart.api.url
    apart.broker.stop()
    try:
        job_id = submit(client, url, 8)
        assert apart.data.client.llen(apart.keys.outbox(0)) == 1
    finally:
        apart.broker.start()
    poll(lambda: client.get(f"{url}/v1/jobs/{job_id}").json()["status"] == "succeeded", "the job's end", 120)
    apart.check_roles()
