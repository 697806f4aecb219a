"""Prometheus metrics of one API process, in a registry per app (tests build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from api.hub import Hub


class Metrics:
    def __init__(self, hub: Hub) -> None:
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "spool_jobs_submitted", "Jobs accepted by POST /v1/jobs", registry=self.registry
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
