"""What one API process holds for its lifetime, opened and closed by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass

from fastapi import FastAPI

from api.batch_feeder import BatchFeeder
from api.context_length import ContextCheck
from api.enqueue import Enqueuer
from api.hub import Hub, Inbox
from api.metrics import Metrics
from api.served import ServedModels
from api.watchers import Watchers
from common.asyncio_tasks import cancel_until_done
from common.process import freeze_startup_objects
from common.redis_errors import UNREACHABLE
from common.redis_policy import check_layout_async, check_redis_async
from common.settings import Settings
from common.store import AsyncBatchStore, AsyncJobStore
from common.store.clients import on_cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Services:
    settings: Settings
    store: AsyncJobStore
    hub: Hub
    enqueuer: Enqueuer
    metrics: Metrics
    watchers: Watchers  # streams per job across API processes; cancels abandoned foreground jobs
    served: ServedModels  # what the live workers serve, for the submit paths' checks
    context: ContextCheck  # refuses what cannot fit the served model's context, before a job exists
    batches: AsyncBatchStore  # files and batches (on the store's Redis client)

    @asynccontextmanager
    async def follow(self, job_id: str, watch: bool) -> AsyncIterator[Inbox]:
        """The job's live events from now on (subscribe before reading its log); with ``watch``
        the caller counts as a watcher of the job meanwhile (api/watchers.py)."""
        async with self.watchers.watch(job_id) if watch else nullcontext(), self.hub.watch(job_id) as inbox:
            yield inbox


async def refuse_unsafe_redis(store: AsyncJobStore) -> None:
    """Raise UnsafeRedis (the process does not start) for a Redis that evicts keys; a Redis not
    reachable yet is not waited for (the API answers 503 until it is)."""
    try:
        await check_redis_async(store.redis, store.settings)
        await check_layout_async(store.redis, store.keys)
        if store.broker is not store.redis:  # SPOOL_BROKER_URL: an evicted queue list loses messages
            await check_redis_async(store.broker, store.settings, broker=True)
    except UNREACHABLE as e:
        log.warning("Redis not checked (eviction policy, cluster), not reachable yet (%s)", e)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    enqueuer = Enqueuer(settings)
    store = AsyncJobStore.from_settings(settings)
    await refuse_unsafe_redis(store)
    hub = Hub(
        settings.redis_url,
        settings.keys,
        client_name=f"{settings.redis_prefix}-api-hub-{os.getpid()}",
        cluster=on_cluster(settings.redis_url),  # as the store's client (common/store/clients.py)
    )
    await hub.start()
    watchers = Watchers(store, settings.detach_grace_s)
    await watchers.start()
    served, context = ServedModels(store), ContextCheck(store)
    batches = AsyncBatchStore(store.redis, settings, store.broker if settings.broker_apart else None)
    app.state.services = Services(
        settings, store, hub, enqueuer, Metrics(hub), watchers, served, context, batches
    )
    # Every API process runs a feeder; one at a time feeds (api/batch_feeder.py).
    feeder = asyncio.create_task(BatchFeeder(settings, store, batches, enqueuer, served, context).run())
    freeze_startup_objects()
    try:
        yield
    finally:
        await cancel_until_done([feeder])
        await watchers.stop()
        await hub.stop()
        await store.close()
