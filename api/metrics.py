"""Prometheus metrics of one API process, in a registry per app (tests build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from api.hub import Hub
from common.schemas import WorkerHeartbeat

# Gauges per live worker, from the engine stats in its heartbeat: (metric, help, stats key).
_ENGINE_GAUGES = (
    ("spool_engine_running_requests", "Requests holding a KV slot", "running"),
    ("spool_engine_waiting_requests", "Requests in the engine waiting for a slot", "waiting"),
    ("spool_engine_slots", "KV-cache slots (the most requests decoded together)", "slots"),
    ("spool_engine_steps", "Engine steps since the worker started", "steps"),
    ("spool_engine_generated_tokens", "Tokens generated since the worker started", "generated_tokens"),
    ("spool_engine_prompt_tokens", "Prompt tokens prefilled since the worker started", "prompt_tokens"),
    ("spool_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("spool_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", "prefix_cache_hits"),
)


class Metrics:
    def __init__(self, hub: Hub) -> None:
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "spool_jobs_submitted",
            "Submits accepted (a submit repeated with its Idempotency-Key counts again)",
            registry=self.registry,
        )
        self.jobs_rejected = Counter(
            "spool_jobs_rejected", "Jobs refused before enqueueing", ["reason"], registry=self.registry
        )
        self.jobs_cancelled = Counter("spool_jobs_cancel_requests", "Cancel requests", registry=self.registry)
        # Read from Redis at scrape time (see routes/health.py), so the figure is the cluster's.
        self.queued_jobs = Gauge("spool_queued_jobs", "Jobs waiting for a worker", registry=self.registry)
        self.workers = Gauge("spool_workers", "Workers with a live heartbeat", registry=self.registry)
        Gauge("spool_sse_streams", "Open SSE streams", registry=self.registry).set_function(
            lambda: hub.open_streams
        )
        Gauge(
            "spool_hub_connected", "1 while the pub/sub hub is subscribed", registry=self.registry
        ).set_function(lambda: float(hub.connected.is_set()))
        Gauge(
            "spool_hub_reconnects", "Pub/sub reconnections since start", registry=self.registry
        ).set_function(lambda: hub.reconnects)
        self._engine = [
            (Gauge(name, f"{text}, per worker (from its heartbeat)", ["worker"], registry=self.registry), key)
            for name, text, key in _ENGINE_GAUGES
        ]

    def set_workers(self, workers: list[WorkerHeartbeat]) -> None:
        """At scrape time: the live workers, their engine figures (a stopped worker's vanish)."""
        self.workers.set(len(workers))
        for gauge, key in self._engine:
            gauge.clear()
            for w in workers:
                if isinstance(w.engine.get(key), int | float):
                    gauge.labels(worker=w.name).set(w.engine[key])
