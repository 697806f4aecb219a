"""The cancel of abandoned foreground jobs decides after a whole grace period, not a moment before."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from api.watchers import Watchers
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus
from common.settings import Settings
from common.store import AsyncJobStore

GRACE_S = 0.2


class EarlyTimersLoop(asyncio.SelectorEventLoop):
    """Timers fire early, as uvloop's can: it reads its clock once per loop iteration, in whole
    milliseconds, so on a loaded machine a timer may fire a few milliseconds before its time.
    Here they fire halfway, so that an early check is seen whatever Redis's round trip."""

    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, **kw: Any
    ) -> asyncio.TimerHandle:
        return super().call_later(delay / 2, callback, *args, **kw)


def test_a_job_its_watcher_left_is_cancelled_even_when_timers_fire_early(prefixes, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    # A check that ran before the grace ended counted the leaver's own ghost, kept the job and
    # never looked again: the job ran to its end for a client that had gone.
    settings = Settings(redis_url=redis_url, redis_prefix=prefixes.new())

    async def scenario() -> JobStatus:
        store = AsyncJobStore.from_settings(settings)
        watchers = Watchers(store, GRACE_S)
        try:
            job = await store.create_job(JobRequest(prompt="hi", max_tokens=1, background=False))
            async with watchers.watch(job.id):
                pass
            for _ in range(50):  # the one check runs at the grace's end: look well past it
                if (status := (await store.get_job(job.id)).status) is not JobStatus.QUEUED:
                    break
                await asyncio.sleep(GRACE_S)
            return status
        finally:
            await watchers.stop()
            await store.close()

    with asyncio.Runner(loop_factory=EarlyTimersLoop) as runner:
        assert runner.run(scenario()) is JobStatus.CANCELLED
