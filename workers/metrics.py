"""Prometheus metrics of one worker process: request latencies, token counts, engine gauges.

Names follow vLLM's (its metrics design: https://docs.vllm.ai/en/latest/design/metrics.html) with
Spool's prefix, each with a ``model_name`` label; docs/metrics.md lists them. The
``spool_tenant_*`` ones also have a ``tenant`` label, a short hash of the API key and never the key
(common/tenants.py), or "anonymous" without keys. Every figure is taken on the engine thread from
what it already has: the job's ``created_at`` (read when the job was taken), the engine's deltas
and ``engine.stats()``. There is no Redis round trip of its own.
``SPOOL_WORKER_METRICS_PORT`` serves them with prometheus_client's HTTP server (``serve``).

A job's created_at is the API's clock (unix seconds), so queue time, TTFT and end to end latency
are measured against the worker's ``time.time()``. Clocks apart by more than a few milliseconds
skew them by as much. Prefill, decode and inter-token figures use the worker's clock only.
Every metric: docs/metrics.md.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.store import Append

if TYPE_CHECKING:  # NOTE: types only: the media worker's metrics import this module, and no engine
    from workers.appends import JobCursor
    from workers.engine import Delta

log = logging.getLogger(__name__)

# Seconds from a millisecond (a GPU's inter-token latency) to ten minutes (a long job on a CPU).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
ANONYMOUS = "anonymous"  # the tenant label of jobs without an API key
# The finish reasons a job's terminal event can carry (publisher._final): each shown from the start.
FINISHED_REASONS = ("stop", "length", "cancelled", "timeout", "error")


@dataclass
class _Timing:
    """One job's timestamps on this worker (unix seconds)."""

    created_at: float
    resumed: bool  # continued from another worker's tokens: its first token here is not the job's
    tenant: str  # the metrics' label (ANONYMOUS without API keys)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class WorkerMetrics:
    """Called from the engine thread only (``added``, ``step``); scraped from the HTTP thread."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._jobs: dict[str, _Timing] = {}
        self._unscheduled: list[str] = []  # jobs in the engine not yet admitted, in the order added
        self._tenants: set[str] = (
            set()
        )  # tenants seen: their waiting gauge is set at every step (0 when none)

        def histogram(name: str, text: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, text, ["model_name"], buckets=buckets, registry=self.registry).labels(
                model_name
            )

        def counter(name: str, text: str) -> Any:
            return Counter(name, text, ["model_name"], registry=self.registry).labels(model_name)

        def gauge(name: str, text: str) -> Any:
            return Gauge(name, text, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram(
            "spool_time_to_first_token_seconds", "Job created to its first token", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "spool_inter_token_latency_seconds", "Between two tokens of one job", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "spool_e2e_request_latency_seconds", "Job created to its last token", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "spool_request_queue_time_seconds",
            "Job created to first scheduled in the engine",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "spool_request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "spool_request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS
        )
        self.prompt_tokens_hist = histogram(
            "spool_request_prompt_tokens", "Prompt tokens per finished job", TOKEN_BUCKETS
        )
        self.generation_tokens_hist = histogram(
            "spool_request_generation_tokens", "Generated tokens per finished job", TOKEN_BUCKETS
        )
        self.prompt_tokens = counter("spool_prompt_tokens", "Prompt tokens of the jobs added to the engine")
        self.generation_tokens = counter("spool_generation_tokens", "Tokens generated")
        self.takeovers = counter(
            "spool_takeovers", "Jobs this worker continued after another worker's attempt"
        )
        success = Counter(
            "spool_request_success",
            "Jobs that ended on this worker, by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.running = gauge("spool_num_requests_running", "Requests holding a KV slot")
        self.waiting = gauge("spool_num_requests_waiting", "Requests in the engine waiting for a slot")
        self.kv_usage = gauge(
            "spool_kv_cache_usage_perc", "Share of the KV cache's token positions in use (0 to 1)"
        )
        tenant = ["model_name", "tenant"]
        self.tenant_tokens = Counter(
            "spool_tenant_tokens",
            "Tokens served per tenant (API key), prompt and generated",
            [*tenant, "kind"],
            registry=self.registry,
        )
        self.tenant_queue_time = Histogram(
            "spool_tenant_queue_time_seconds",
            "Job created to first scheduled in the engine, per tenant",
            tenant,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tenant_waiting = Gauge(
            "spool_tenant_requests_waiting",
            "Jobs in the engine waiting for a slot, per tenant",
            tenant,
            registry=self.registry,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on ``port`` from a daemon thread (prometheus_client's own server)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def added(
        self,
        job_id: str,
        created_at: float,
        prompt_tokens: int,
        attempt: int,
        resumed: bool,
        tenant: str = "",
    ) -> None:
        """The job went into the engine (its prompt is counted once per attempt)."""
        label = tenant or ANONYMOUS
        self._tenants.add(label)
        self._jobs[job_id] = _Timing(created_at, resumed, label)
        self._unscheduled.append(job_id)
        self.prompt_tokens.inc(prompt_tokens)
        self.tenant_tokens.labels(self.model_name, label, "prompt").inc(prompt_tokens)
        if attempt > 1:
            self.takeovers.inc()

    def step(
        self,
        started: float,
        deltas: Sequence[Delta],
        appends: Sequence[Append],
        stats: Mapping[str, Any],
        waiting: Collection[str],
    ) -> None:
        """After one engine step that began at ``started`` (unix s): its deltas and their writes,
        and the jobs still ``waiting`` in the engine for a slot.

        Never raises: the runtime calls it before handing the step's writes to the writer, and a
        fault in a figure must not cost a job its events.
        """
        try:
            self._step(started, deltas, appends, stats, waiting)
        except Exception:
            log.exception("could not record the step's metrics; going on")

    def _step(
        self,
        started: float,
        deltas: Sequence[Delta],
        appends: Sequence[Append],
        stats: Mapping[str, Any],
        waiting: Collection[str],
    ) -> None:
        now = time.time()
        # A job that ended without a token this step left the engine's waiting queue unscheduled.
        with_token = {d.request_id for d in deltas if d.token_ids}
        ended_waiting = {a.job_id for a in appends if a.final is not None} - with_token
        self._schedule(started, waiting, ended_waiting)
        for d in deltas:
            if d.token_ids:
                self._token(d.request_id, len(d.token_ids), now)
        for a in appends:
            if a.final is not None:
                self._finished(a, now)
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))

    def _schedule(self, started: float, waiting: Collection[str], gone: set[str]) -> None:
        # NOTE: by the engine's own list: it admits by priority and fair share, not in the order added.
        unscheduled = [j for j in self._unscheduled if j in self._jobs and j not in gone]
        self._unscheduled = [j for j in unscheduled if j in waiting]
        for job_id in unscheduled:
            if job_id in waiting:
                continue
            t = self._jobs[job_id]
            t.scheduled_at = started
            if not t.resumed:
                self.queue_time.observe(max(started - t.created_at, 0.0))
                self.tenant_queue_time.labels(self.model_name, t.tenant).observe(
                    max(started - t.created_at, 0.0)
                )
        per_tenant = collections.Counter(self._jobs[j].tenant for j in self._unscheduled)
        for tenant in self._tenants:
            self.tenant_waiting.labels(self.model_name, tenant).set(per_tenant[tenant])

    def _token(self, job_id: str, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        t = self._jobs.get(job_id)
        if t is None:
            return
        self.tenant_tokens.labels(self.model_name, t.tenant, "generated").inc(n)
        if t.first_token_at is None:
            t.first_token_at = now
            if not t.resumed:
                self.ttft.observe(max(now - t.created_at, 0.0))
            if t.scheduled_at is not None:
                self.prefill_time.observe(now - t.scheduled_at)
        elif t.last_token_at is not None:
            self.itl.observe(now - t.last_token_at)
        t.last_token_at = now

    def _finished(self, a: Append, now: float) -> None:
        assert a.final is not None
        self.success.get(a.final.finish_reason or "error", self.success["error"]).inc()
        t = self._jobs.pop(a.job_id, None)
        if t is None:  # ended before it reached the engine (cancelled, timed out, done earlier)
            return
        self.e2e.observe(max(now - t.created_at, 0.0))
        if t.first_token_at is not None:
            self.decode_time.observe(now - t.first_token_at)
        self.prompt_tokens_hist.observe(a.prompt_tokens)
        self.generation_tokens_hist.observe(a.completion_tokens)

    def dropped(self, job_id: str) -> None:
        """Another worker took the job over: forget it without a finish."""
        self._jobs.pop(job_id, None)


def per_job(deltas: list[Delta], cursors: dict[str, JobCursor]) -> list[Delta]:
    """The deltas as the metrics count them: per job (a job with n > 1 has one per choice)."""
    if not any(cursors[d.request_id].choice_of for d in deltas if d.request_id in cursors):
        return deltas
    by_job: dict[str, Delta] = {}
    for d in deltas:
        cursor = cursors.get(d.request_id)
        job_id = cursor.job_id if cursor is not None else d.request_id
        had = by_job.get(job_id)
        ids = (*had.token_ids, *d.token_ids) if had is not None else d.token_ids
        by_job[job_id] = replace(d, request_id=job_id, token_ids=ids)
    return list(by_job.values())


def job_sets(
    running: list[str], waiting: list[str], cursors: dict[str, JobCursor]
) -> tuple[set[str], set[str]]:
    """The jobs of the engine's running and waiting requests, as the metrics count them: a job runs
    while any of its choices holds a slot, and waits while none does yet."""

    def job_of(engine_id: str) -> str:
        return cursors[engine_id].job_id if engine_id in cursors else engine_id

    jobs_running = set(map(job_of, running))
    return jobs_running, set(map(job_of, waiting)) - jobs_running
