"""The submit paths' view of the served models: kept for a while when a worker is live, never when none is."""

from __future__ import annotations

import asyncio
import time

from api.served import ServedModels
from common.schemas.views import WorkerHeartbeat
from common.settings import Settings
from common.store import AsyncJobStore, SyncJobStore


def test_served_models_are_kept_while_a_worker_lives_and_never_while_none_does(
    prefixes, redis_url: str
) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(redis_url=redis_url, redis_prefix=prefixes.new())
    store = SyncJobStore.from_settings(settings)
    beat = WorkerHeartbeat(name="w1", ts=time.time(), engine={}, model="tiny")

    async def scenario() -> None:
        astore = AsyncJobStore.from_settings(settings)
        kept, fresh = ServedModels(astore, ttl_s=3600), ServedModels(astore, ttl_s=0)
        try:
            assert await kept.get() == {}
            store.beat(beat)
            assert await kept.get() == {"tiny": beat}  # "no worker" was not kept: seen at once
            store.remove_heartbeat("w1")
            assert await kept.get() == {"tiny": beat}  # kept for its ttl
            assert await fresh.get() == {}
            # A burst on an expired view reads Redis once, and every caller gets that answer.
            store.beat(beat)
            reads = 0
            list_workers = astore.list_workers

            async def counted() -> list[WorkerHeartbeat]:
                nonlocal reads
                reads += 1
                return await list_workers()

            astore.list_workers = counted  # type: ignore[method-assign]
            burst = ServedModels(astore, ttl_s=3600)
            assert await asyncio.gather(*(burst.get() for _ in range(32))) == [{"tiny": beat}] * 32
            assert reads == 1
        finally:
            await astore.close()
            store.close()

    asyncio.run(scenario())


def test_media_pipelines_are_kept_as_the_text_models_are(prefixes, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(redis_url=redis_url, redis_prefix=prefixes.new())
    store = SyncJobStore.from_settings(settings)
    text = WorkerHeartbeat(name="w1", ts=time.time(), engine={}, model="tiny")
    media = WorkerHeartbeat(name="m1", ts=time.time(), engine={}, model="tiny-sd", kind="media")

    async def scenario() -> None:
        astore = AsyncJobStore.from_settings(settings)
        served = ServedModels(astore, ttl_s=3600)
        try:
            store.beat(text)
            assert await served.get() == {"tiny": text}
            assert await served.media() == frozenset()
            store.beat(media)
            # Seen at once, though the text models read with "no media worker" are still kept.
            assert await served.media() == {"tiny-sd"}
            assert await served.get() == {"tiny": text}  # a media worker is no text model
            store.remove_heartbeat("m1")
            assert await served.media() == {"tiny-sd"}  # kept for its ttl
        finally:
            await astore.close()
            store.close()

    asyncio.run(scenario())
