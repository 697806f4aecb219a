"""Hands job ids to the workers through Celery, by task name, so the API never imports workers/.

Submits that arrive while a send is in flight go out together in the next one: one thread hop
and one Redis round trip (kombu's ``Producer.batch``) for a whole burst. Celery's ``send_task``
costs about 1 ms of CPU a message here when each is sent alone (kombu builds a Redis client per
publish), about 0.4 ms in a batch of 32 (docs/benchmarks.md). A submit alone is sent at once.
"""

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
        self._waiting: list[tuple[str, asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def generate(self, job_id: str) -> None:
        """Returns once the job's message is with the broker; raises if it could not be sent
        (kombu's ``OperationalError``, or ``BatchPublishError`` when the outcome is unknown)."""
        sent = asyncio.get_running_loop().create_future()
        self._waiting.append((job_id, sent))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_waiting(), name="spool-enqueue")
        await sent

    async def _send_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                # send_task blocks on the broker round trip; keep it off the event loop.
                await asyncio.to_thread(self._send, [job_id for job_id, _ in batch])
            except Exception as e:  # noqa: BLE001 (whatever it is, each submitter gets it)
                for _, sent in batch:
                    if not sent.done():  # (done: its request was cancelled, the client gone)
                        sent.set_exception(e)
            else:
                for _, sent in batch:
                    if not sent.done():
                        sent.set_result(None)

    def _send(self, job_ids: list[str]) -> None:
        with self._celery.producer_or_acquire() as producer, producer.batch():
            for job_id in job_ids:
                self._celery.send_task(
                    GENERATE_TASK,
                    args=[job_id],
                    queue=self._queue,
                    priority=JOB_PRIORITY,
                    retry_policy=_RETRY_POLICY,
                    producer=producer,
                )

    def close(self) -> None:
        self._celery.close()
