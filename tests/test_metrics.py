"""Metrics read from a live worker's and a live API's endpoints after real jobs ran through them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from procs import Prefixes, Service, finished_job, free_port, start_api, start_worker, wait_until
from prom import DEPLOY, MEDIA_PREFIX, Samples, dashboard_exprs, dashboard_metrics, scrape
from sse_client import Event, iter_sse

from api.metrics import REJECT_REASONS


@dataclass(frozen=True)
class Stack:
    worker: Service
    worker_metrics: str  # the worker's /metrics URL
    api: Service
    model: Path  # the worker's SPOOL_MODEL, whose directory's name is its metrics' model_name


@pytest.fixture(scope="module")
def stack(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Stack]:
    prefix, port = prefixes.new(), free_port()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=4, worker_metrics_port=port)
    api = start_api(prefix, log_dir)
    yield Stack(worker, f"http://127.0.0.1:{port}/metrics", api, tiny_model)
    api.stop()
    worker.stop()


def value(samples: Samples, name: str, **labels: str) -> float:
    matching = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert matching, f"{name}{labels} not exported"
    return sum(matching)


@dataclass(frozen=True)
class Timed:
    submitted: float  # time.time() before the POST
    first_token: float  # when the first token event arrived
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def streamed_job(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> Timed:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    submitted, first = time.time(), 0.0
    with client.stream("POST", f"{url}/v1/jobs", json=body) as r:
        assert r.status_code == 200, r.read()
        for item in iter_sse(r):
            if isinstance(item, Event) and item.event == "token" and not first:
                first = time.time()
            if isinstance(item, Event) and item.terminal:
                done = item.data
    usage = done["usage"]
    return Timed(submitted, first, usage["prompt_tokens"], usage["completion_tokens"], done["finish_reason"])


def test_worker_histograms_and_counters_match_the_jobs(stack: Stack, client: httpx.Client) -> None:
    jobs = [streamed_job(client, stack.api.url, f"metrics job {i}", 6 + 3 * i) for i in range(4)]
    m = scrape(stack.worker_metrics)
    model = {"model_name": stack.model.name}
    n = len(jobs)
    for h in (
        "spool_time_to_first_token_seconds",
        "spool_e2e_request_latency_seconds",
        "spool_request_queue_time_seconds",
        "spool_request_prefill_time_seconds",
        "spool_request_decode_time_seconds",
        "spool_request_prompt_tokens",
        "spool_request_generation_tokens",
    ):
        assert value(m, f"{h}_count", **model) == n, h
    # The worker's TTFT of each job lies between the job's creation and its first token's arrival
    # here, so their sum is within what this test measured from its own POSTs.
    ttft_sum = value(m, "spool_time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= sum(j.first_token - j.submitted for j in jobs)
    generated = sum(j.completion_tokens for j in jobs)
    assert value(m, "spool_generation_tokens_total") == generated
    assert value(m, "spool_prompt_tokens_total") == sum(j.prompt_tokens for j in jobs)
    assert value(m, "spool_request_generation_tokens_sum") == generated
    assert value(m, "spool_inter_token_latency_seconds_count") == generated - n
    for reason in ("stop", "length", "cancelled", "timeout", "error"):  # every label from the start
        expected = sum(j.finish_reason == reason for j in jobs)
        assert value(m, "spool_request_success_total", finished_reason=reason) == expected, reason
    assert value(m, "spool_num_requests_running") == 0
    assert value(m, "spool_kv_cache_usage_perc") == 0
    assert value(m, "spool_takeovers_total") == 0


def test_api_counts_routes_refusals_and_resumes(stack: Stack, client: httpx.Client) -> None:
    url = stack.api.url
    before = scrape(f"{url}/metrics")
    for reason in REJECT_REASONS:  # every reason from the start, and typed as counters
        assert ("spool_jobs_rejected_total", frozenset({("reason", reason)})) in before, reason
    assert client.post(f"{url}/v1/jobs", json={"prompt": "p", "temperature": -1}).status_code == 422
    assert client.post(f"{url}/v1/jobs", json={"prompt": "p", "max_tokens": 10**6}).status_code == 400
    assert (
        client.post(
            f"{url}/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    # an OpenAI route's schema violation is a 400 named by pydantic's type, still a bad request
    assert client.post(f"{url}/v1/completions", json={"prompt": "p", "top_p": 3}).status_code == 400
    deep: object = "p"
    for _ in range(100):
        deep = [deep]
    assert client.post(f"{url}/v1/jobs", json={"prompt": "p", "stop": deep}).status_code == 400
    job = client.post(f"{url}/v1/jobs", json={"prompt": "p", "max_tokens": 3}).json()
    finished_job(client, url, job["id"])
    assert client.get(f"{url}/v1/jobs/{job['id']}/events?after=1").status_code == 200
    after = scrape(f"{url}/metrics")

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - (
            value(before, name, **labels)
            if any(n == name and set(labels.items()) <= ls for n, ls in before)
            else 0
        )

    assert grew("spool_jobs_rejected_total", reason="invalid_request") == 2
    assert grew("spool_jobs_rejected_total", reason="json_too_deep") == 1
    assert grew("spool_jobs_rejected_total", reason="other") == 0
    # past the cap and the model's context: the one 400 says the context (api/context_length.py)
    assert grew("spool_jobs_rejected_total", reason="context_length_exceeded") == 1
    assert grew("spool_jobs_rejected_total", reason="invalid_json") == 1
    assert grew("spool_jobs_submitted_total") == 1
    assert grew("spool_sse_resumes_total") == 1
    assert grew("spool_http_requests_total", method="POST", route="/v1/jobs", status="422") == 1
    assert (
        grew("spool_http_requests_total", method="GET", route="/v1/jobs/{job_id}/events", status="200") == 1
    )
    assert value(after, "spool_queue_depth", queue="llm") == 0
    assert value(after, "spool_queue_depth", queue="media") == 0
    # Cumulative engine figures from the heartbeat are counters (a rate() over them makes sense);
    # the next beat (every 0.5 s here) carries this test's tokens.
    wait_until(
        lambda: value(scrape(f"{url}/metrics"), "spool_engine_generated_tokens_total") > 0, "a beat", 10
    )
    assert ("spool_engine_steps_total", frozenset({("worker", f"{stack.api.prefix}-w1")})) in scrape(
        f"{url}/metrics"
    )


def test_monitoring_files_parse_and_point_at_the_services() -> None:
    compose = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        for volume in compose[name]["volumes"]:
            assert (DEPLOY.parent / volume.split(":")[0]).exists(), (
                volume
            )  # every mounted file is in the repo
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    ports = {job["job_name"]: job["dns_sd_configs"][0] for job in scrape["scrape_configs"]}
    worker_port = compose["worker"]["environment"]["SPOOL_WORKER_METRICS_PORT"]
    assert ports["spool-worker"] == {"names": ["worker"], "type": "A", "port": int(worker_port)}
    media_port = compose["media-worker"]["environment"]["SPOOL_WORKER_METRICS_PORT"]
    assert ports["spool-media-worker"] == {"names": ["media-worker"], "type": "A", "port": int(media_port)}
    api_command = compose["api"]["command"]
    assert ports["spool-api"]["port"] == int(api_command[api_command.index("--port") + 1])
    for f in (DEPLOY / "grafana/provisioning").rglob("*.yml"):
        assert yaml.safe_load(f.read_text())["apiVersion"] == 1
    assert dashboard_exprs()


def test_every_metric_the_dashboard_names_is_exported(stack: Stack, client: httpx.Client) -> None:
    streamed_job(client, stack.api.url, "labelled series", 2)  # the per-tenant ones exist once a job ran
    exported = {name for name, _ in scrape(stack.worker_metrics)} | {
        name for name, _ in scrape(f"{stack.api.url}/metrics")
    }
    named = {m for m in dashboard_metrics() if not m.startswith(MEDIA_PREFIX)}
    assert named, "the dashboard names no metric"
    assert named <= exported, sorted(named - exported)
    # The labels its queries group and filter by are the exported ones.
    samples = scrape(stack.worker_metrics) | scrape(f"{stack.api.url}/metrics")
    assert {"model_name", "finished_reason", "queue", "reason", "status"} <= {
        k for _, labels in samples for k, _ in labels
    }
