"""Prometheus metrics of one media worker process: image parts, denoising steps, queue wait.

They are served as a text worker's are (workers/metrics.py), on ``SPOOL_WORKER_METRICS_PORT`` with
the ``model_name`` label and the same latency buckets. They come from what the runtime already
has, the part's ``created_at`` and its own clock around each denoising step, with no Redis round
trip of their own. Images per second is ``rate(spool_image_parts_total{status="succeeded"})``.

Queue wait and end to end compare the worker's clock with the API's ``created_at``. A part that
takes its prompt from a text part waits for it, and that wait counts. A denoising step's time is
the worker's clock only and leaves out the step's write to Redis. Every metric: docs/metrics.md.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from workers.metrics import LATENCY_BUCKETS

# How an image part ended on this worker (each shown from the start).
PART_STATUSES = ("succeeded", "failed", "cancelled")


class MediaMetrics:
    """Observed on the task thread that runs the part; scraped from the HTTP thread."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, text: str) -> Any:
            return Histogram(
                name, text, ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry
            ).labels(model_name)

        self.queue_time = histogram(
            "spool_image_queue_time_seconds", "Image part created to taken by this worker (first attempt)"
        )
        self.step_time = histogram("spool_image_denoise_step_seconds", "One denoising step of the pipeline")
        self.hold_time = histogram(
            "spool_image_hold_seconds",
            "Held image part created to its message sent, at its job's text parts' first tokens or the bound",
        )
        self.generation_time = histogram(
            "spool_image_generation_seconds",
            "Image part's pipeline called to its image made (succeeded parts)",
        )
        self.e2e = histogram(
            "spool_image_e2e_seconds", "Image part created to its end written (succeeded parts)"
        )
        parts = Counter(
            "spool_image_parts",
            "Image parts that ended on this worker, by status",
            ["model_name", "status"],
            registry=self.registry,
        )
        self.parts = {s: parts.labels(model_name, s) for s in PART_STATUSES}
        self.steps = Counter(
            "spool_image_denoise_steps", "Denoising steps run", ["model_name"], registry=self.registry
        ).labels(model_name)
        self.takeovers = Counter(
            "spool_takeovers",
            "Parts this worker ran again after another worker's attempt",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self.running = Gauge(
            "spool_image_parts_running",
            "Image parts running (0 or 1)",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def taken(self, created_at: float, attempt: int, now: float) -> None:
        self.running.set(1)
        if attempt > 1:
            self.takeovers.inc()
        else:
            self.queue_time.observe(max(now - created_at, 0.0))

    def held(self, seconds: float) -> None:
        self.hold_time.observe(max(seconds, 0.0))

    def step(self, seconds: float) -> None:
        self.steps.inc()
        self.step_time.observe(max(seconds, 0.0))

    def ended(self, status: str, created_at: float, begun_at: float, now: float) -> None:
        """The part's end was written (``status``: succeeded, failed or cancelled; ``begun_at``:
        its pipeline called)."""
        self.running.set(0)
        self.parts.get(status, self.parts["failed"]).inc()
        if status == "succeeded":
            self.generation_time.observe(max(now - begun_at, 0.0))
            self.e2e.observe(max(now - created_at, 0.0))

    def left(self) -> None:
        """The part left this worker without an end of its own (lost, or the worker stops)."""
        self.running.set(0)
