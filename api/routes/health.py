"""Liveness, readiness and Prometheus metrics.

What each probe says and when: docs/operations.md#monitoring.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import ServicesDep, StoreDep
from api.errors import ApiError
from api.metrics import BATCH_LIVE
from api.served import queued_models
from common.store.hooks import AsyncHookStore

router = APIRouter(tags=["operations"])


@router.get("/healthz")
@router.get("/health")  # vLLM's name for it, which benchmark tools (guidellm) probe
async def healthz() -> dict[str, str]:
    """The process is up; says nothing about Redis or workers (that is /readyz)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(store: StoreDep) -> dict[str, Any]:
    """Ready when Redis takes a write and at least one worker that runs jobs (text or media: a
    hook worker alone runs none) has a fresh heartbeat (its key has a TTL). Redis out of memory
    answers reads and refuses writes: not ready (503)."""
    await store.probe_write()  # Redis refusing it: the 503 envelope with Retry-After (api/errors.py)
    workers = await store.list_workers()
    if not any(w.kind != "hooks" for w in workers):
        raise ApiError(
            503, "No text or media worker is running (no live heartbeat in Redis)", code="no_worker"
        )
    return {"status": "ready", "workers": [w.public() for w in workers]}


@router.get("/metrics")
async def metrics(services: ServicesDep) -> Response:
    m = services.metrics
    m.queued_jobs.set(await services.store.queued_count())
    workers = await services.store.list_workers()
    m.set_queue_depths(await services.store.queue_depths(await queued_models(services.store)))
    m.set_workers(workers)
    m.set_batches(await services.batches.batch_counts(BATCH_LIVE))
    m.webhook_backlog.set(await AsyncHookStore(services.store.redis, services.settings).backlog())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
