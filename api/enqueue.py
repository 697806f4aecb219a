"""Hands job ids to the workers through Celery, by task name, so the API never imports workers/."""

from __future__ import annotations

import asyncio

from celery import Celery

from common.keys import GENERATE_TASK, JOB_PRIORITY
from common.settings import Settings

# Fail fast when the broker is down (the client gets a 503 and can retry) instead of letting
# Celery's default policy hold the request for seconds.
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


class Enqueuer:
    def __init__(self, settings: Settings) -> None:
        # A bare app: only the broker matters for send_task; the worker defines the task.
        self._celery = Celery("spool-api", broker=settings.redis_url, set_as_current=False)
        self._queue = settings.keys.queue_llm

    async def generate(self, job_id: str) -> None:
        # send_task blocks on the broker round trip; keep it off the event loop.
        await asyncio.to_thread(
            self._celery.send_task,
            GENERATE_TASK,
            args=[job_id],
            queue=self._queue,
            priority=JOB_PRIORITY,
            retry_policy=_RETRY_POLICY,
        )

    def close(self) -> None:
        self._celery.close()
