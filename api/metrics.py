"""Prometheus metrics of one API process, in a registry per app (tests build several apps).

Latency figures live on the workers (workers/metrics.py), where the tokens are made; the API
counts its own traffic, and at scrape time reads the cluster's queue depths and the engine
figures of every live worker's heartbeat.

Every metric: docs/metrics.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.hub import Hub
from common.schemas.views import WorkerHeartbeat
from common.store import BATCH_LINE_STATES, BatchCounts

# Per live worker, from the engine stats in its heartbeat: (metric, help, stats key).
_ENGINE_GAUGES = (
    ("spool_engine_running_requests", "Requests holding a KV slot", "running"),
    ("spool_engine_waiting_requests", "Requests in the engine waiting for a slot", "waiting"),
    ("spool_engine_slots", "KV-cache slots (the most requests decoded together)", "slots"),
    (
        "spool_engine_kv_cache_usage",
        "Share of the KV cache's token positions in use (0 to 1)",
        "kv_cache_usage",
    ),
)
_ENGINE_COUNTERS = (
    ("spool_engine_steps", "Engine steps since the worker started", "steps"),
    ("spool_engine_generated_tokens", "Tokens generated since the worker started", "generated_tokens"),
    ("spool_engine_prompt_tokens", "Prompt tokens prefilled since the worker started", "prompt_tokens"),
    (
        "spool_engine_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        "prefix_cache_queries",
    ),
    (
        "spool_engine_prefix_cache_hits",
        "Prompt tokens found in the prefix cache (not computed)",
        "prefix_cache_hits",
    ),
    (
        "spool_engine_preemptions",
        "Running requests (batch lines) whose slot went to a higher-priority request",
        "preemptions",
    ),
)
# Why a submit was refused: its error code (api/errors.py, api/served.py). A schema violation
# (the jobs API's 422, an OpenAI route's 400 named by pydantic's error type) counts as
# "invalid_request"; any other code counts as "other".
REJECT_REASONS = (
    "queue_full",
    "invalid_request",
    "invalid_json",
    "json_too_deep",
    "limit_exceeded",
    "body_too_large",
    "unsupported_parameter",
    "model_not_found",
    "no_chat_template",
    "context_length_exceeded",
    "idempotency_key_reused",
    "priority_not_allowed",
    "no_worker",
    "backend_unavailable",
    "other",
)
# OpenAI's batch statuses; the batches not ended yet are the ones whose lines are counted by state.
BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
BATCH_LIVE = ("validating", "in_progress", "finalizing", "cancelling")  # the batches whose lines count
SUBMIT_PATHS = frozenset(
    {"/v1/jobs", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"}
)


class _Heartbeats(Collector):
    """The engine figures of the workers read at the last scrape (a stopped worker's vanish)."""

    def __init__(self) -> None:
        self.workers: list[WorkerHeartbeat] = []

    def collect(self) -> Iterator[Metric]:
        families: list[tuple[Any, str]] = [
            (GaugeMetricFamily(name, f"{text}, per worker (from its heartbeat)", labels=["worker"]), key)
            for name, text, key in _ENGINE_GAUGES
        ] + [
            (CounterMetricFamily(name, f"{text}, per worker (from its heartbeat)", labels=["worker"]), key)
            for name, text, key in _ENGINE_COUNTERS
        ]
        for family, key in families:
            for w in self.workers:
                if isinstance(w.engine.get(key), int | float):
                    family.add_metric([w.name], w.engine[key])
            yield family


class Metrics:
    def __init__(self, hub: Hub) -> None:
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "spool_jobs_submitted",
            "Submits accepted (a submit repeated with its Idempotency-Key counts again)",
            registry=self.registry,
        )
        self.jobs_rejected = Counter(
            "spool_jobs_rejected",
            "Submits refused before enqueueing, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in REJECT_REASONS:
            self.jobs_rejected.labels(reason)
        self.jobs_cancelled = Counter("spool_jobs_cancel_requests", "Cancel requests", registry=self.registry)
        self.http_requests = Counter(
            "spool_http_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.sse_resumes = Counter(
            "spool_sse_resumes",
            "Event streams opened after an event id (Last-Event-ID or ?after)",
            registry=self.registry,
        )
        # Read from Redis at scrape time (see routes/health.py), so the figures are the cluster's.
        self.queued_jobs = Gauge("spool_queued_jobs", "Jobs waiting for a worker", registry=self.registry)
        self.queue_depth = Gauge(
            "spool_queue_depth",
            "Messages in a Celery queue, not yet taken",
            ["queue"],
            registry=self.registry,
        )
        self.batches = Gauge(
            "spool_batches",
            "Stored batches (until they expire), by status",
            ["status"],
            registry=self.registry,
        )
        self.batch_lines = Gauge(
            "spool_batch_lines",
            "Request lines of the batches not ended yet, by state",
            ["state"],
            registry=self.registry,
        )
        for status in BATCH_STATUSES:
            self.batches.labels(status)
        for state in BATCH_LINE_STATES:
            self.batch_lines.labels(state)
        self.workers = Gauge("spool_workers", "Workers with a live heartbeat", registry=self.registry)
        self.webhook_backlog = Gauge(
            "spool_webhook_backlog",
            "Jobs and batches with a webhook delivery pending",
            registry=self.registry,
        )
        Gauge("spool_sse_streams", "Open SSE streams", registry=self.registry).set_function(
            lambda: hub.open_streams
        )
        Gauge(
            "spool_hub_connected",
            "1 while the pub/sub hub is subscribed (each connection, one per master on a cluster)",
            registry=self.registry,
        ).set_function(lambda: float(hub.connected.is_set()))
        Gauge(
            "spool_hub_reconnects", "Pub/sub reconnections since start", registry=self.registry
        ).set_function(lambda: hub.reconnects)
        self._heartbeats = _Heartbeats()
        self.registry.register(self._heartbeats)

    def set_workers(self, workers: list[WorkerHeartbeat]) -> None:
        """At scrape time: the live workers and their engine figures."""
        self.workers.set(len(workers))
        self._heartbeats.workers = workers

    def set_queue_depths(self, depths: Iterable[tuple[str, int]]) -> None:
        for queue, n in depths:
            self.queue_depth.labels(queue).set(n)

    def set_batches(self, counts: BatchCounts) -> None:
        """At scrape time: the batches by status, and the lines of the live ones by state."""
        for status in BATCH_STATUSES:
            self.batches.labels(status).set(counts.statuses.get(status, 0))
        for state, n in counts.lines.items():
            self.batch_lines.labels(state).set(n)

    def rejected(self, status: int, code: str | None) -> None:
        if code in REJECT_REASONS:
            reason = code
        else:
            reason = "invalid_request" if status in (400, 422) else "other"
        self.jobs_rejected.labels(reason).inc()


class RequestMetricsMiddleware:
    """Counts every answer by route template (``/v1/jobs/{job_id}``, so ids make no new series)
    and status, and every refused submit by its error code. Outermost, so a 401 counts too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # a handler that raised past every error handler
        refusal = bytearray()  # the error body of a refused submit, for its code

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and self._is_refusal(scope, status):
                refusal.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            metrics = self._metrics(scope)
            if metrics is not None:
                route = getattr(scope.get("route"), "path", "other")
                metrics.http_requests.labels(scope["method"], route, str(status)).inc()
                if self._is_refusal(scope, status):
                    metrics.rejected(status, _error_code(bytes(refusal)))

    @staticmethod
    def _is_refusal(scope: Scope, status: int) -> bool:
        return status >= 400 and status != 401 and scope["method"] == "POST" and scope["path"] in SUBMIT_PATHS

    @staticmethod
    def _metrics(scope: Scope) -> Metrics | None:
        services = getattr(scope["app"].state, "services", None)  # None before the lifespan ran
        return services.metrics if services is not None else None


def _error_code(body: bytes) -> str | None:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None
