"""The job data on a real Redis Cluster (three masters), the broker on a standalone Redis apart
(issue 31): jobs equal to the greedy reference with their keys on every master, a stream that
resumes by id, a batch, and a worker killed mid-job whose job another worker takes over.

The stack is the one the other tests run, with SPOOL_REDIS_URL naming one node of the cluster,
SPOOL_BROKER_URL a standalone Redis and SPOOL_REDIS_BUCKETS the cluster's buckets
(common/keys.py; tests/redis_cluster.py cluster_stack), so every script's keys share a hash slot
and job events go over shard channels.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from greedy import greedy
from procs import Prefixes, wait_until
from redis_cluster import ClusterStack, cluster_stack
from sse_client import Event, check_full_stream, iter_sse, read_events

LEASE_S = 3.0  # a killed worker's jobs are taken over after this


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> Iterator[ClusterStack]:
    base = tmp_path_factory.mktemp("redis-cluster")
    with cluster_stack(
        base, prefixes.new(), tiny_model, log_dir, lease_s=LEASE_S, max_batch_size=32
    ) as stack:
        yield stack


def reference(stack: ClusterStack, prompt: str, max_tokens: int) -> str:
    return greedy(stack.model, prompt, max_tokens).text


def submit(client: httpx.Client, stack: ClusterStack, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = client.post(f"{stack.api.url}/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def finished(client: httpx.Client, stack: ClusterStack, job_id: str, timeout: float = 120) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def ended() -> bool:
        job.update(client.get(f"{stack.api.url}/v1/jobs/{job_id}").json())
        return job["status"] in ("succeeded", "failed", "cancelled")

    wait_until(ended, f"job {job_id} to end", timeout)
    return job


def master_of(stack: ClusterStack, key: str) -> str:
    node = stack.data.get_node_from_key(key)
    return f"{node.host}:{node.port}"


def test_jobs_equal_the_reference_with_their_keys_on_every_master(stack: ClusterStack) -> None:
    prompts = [f"story number {i} begins with" for i in range(24)]
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda p: submit(client, stack, p, 16), prompts))
        jobs = list(pool.map(lambda j: finished(client, stack, j), ids))
    for prompt, job in zip(prompts, jobs, strict=True):
        assert job["status"] == "succeeded", job
        assert job["text"] == reference(stack, prompt, 16)
    # Each job's hash and log sit on the master of its bucket's slot, and the jobs on all three.
    masters = {master_of(stack, stack.keys.job(j)) for j in ids}
    assert len(masters) == 3
    for job_id in ids:
        node = redis.Redis.from_url(f"redis://{master_of(stack, stack.keys.job(job_id))}/0")
        with node:
            assert node.exists(stack.keys.job(job_id), stack.keys.job_log(job_id)) == 2


def test_a_stream_resumes_by_id_on_shard_channels(stack: ClusterStack) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.api.url}/v1/jobs", json=body) as r:
            assert r.status_code == 200, r.read()
            location = r.headers["location"]
            head = list(itertools.islice((e for e in iter_sse(r) if isinstance(e, Event)), 5))
        rest = read_events(client, f"{stack.api.url}{location}/events", last_event_id=5)
    assert [e.id for e in head] == [1, 2, 3, 4, 5]
    assert check_full_stream(head + rest) == reference(stack, "Once upon a time", 32)


def test_a_batch_runs_its_lines_in_its_owners_bucket(stack: ClusterStack) -> None:
    prompts = [f"line {i} says" for i in range(6)]
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 8, "temperature": 0},
        }
        for i, p in enumerate(prompts)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with httpx.Client(base_url=stack.api.url, timeout=60) as client:
        file_id = client.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
        ).json()["id"]
        batch = client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()
        ended: dict[str, Any] = {}

        def done() -> bool:
            ended.update(client.get(f"/v1/batches/{batch['id']}").json())
            return ended["status"] in ("completed", "failed", "expired", "cancelled")

        wait_until(done, "the batch to end", 120)
        assert ended["status"] == "completed", ended
        output = [
            json.loads(x)
            for x in client.get(f"/v1/files/{ended['output_file_id']}/content").text.splitlines()
        ]
    texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in output}
    assert texts == {f"c{i}": reference(stack, p, 8) for i, p in enumerate(prompts)}
    assert stack.keys.bucket_of(batch["id"]) == stack.keys.bucket_of(file_id) == stack.keys.owner_bucket("")


def test_a_killed_workers_job_is_taken_over(stack: ClusterStack) -> None:
    """Killed mid-job (SIGKILL: no goodbye), its lease lapses; another worker takes the job over
    from its log in the cluster and ends it as one run would have."""
    with httpx.Client(timeout=60) as client:
        job_id = submit(client, stack, "the long road home", 200)
        log = stack.keys.job_log(job_id)
        wait_until(lambda: stack.data.llen(log) >= 5, "its first tokens", 60)
        victim = stack.workers[0]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(30)
        stack.start_worker("w2")
        job = finished(client, stack, job_id)
    assert job["status"] == "succeeded", job
    assert job["text"] == reference(stack, "the long road home", 200)
    assert stack.data.hget(stack.keys.job(job_id), "attempt") == "2"
