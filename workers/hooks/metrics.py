"""Prometheus metrics of one hook worker process (``SPOOL_WORKER_METRICS_PORT``), as a text
worker serves its own (workers/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# What became of an attempt: delivered (2xx), retried (another attempt is due), failed (given up
# past SPOOL_WEBHOOK_HORIZON_S, or at once for an address the guard refuses), disabled (410, or its
# URL disabled before).
OUTCOMES = ("delivered", "retried", "failed", "disabled")
ATTEMPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)


class HookMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        deliveries = Counter(
            "spool_webhook_deliveries",
            "Webhook delivery attempts by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._outcomes = {o: deliveries.labels(o) for o in OUTCOMES}
        self.attempt_time = Histogram(
            "spool_webhook_attempt_seconds",
            "One delivery attempt: resolve, connect, send, the answer",
            buckets=ATTEMPT_BUCKETS,
            registry=self.registry,
        )

    def outcome(self, name: str) -> None:
        self._outcomes[name].inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
