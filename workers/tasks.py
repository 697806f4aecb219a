"""The Celery task: hands a job id to this process's EngineRuntime and waits for the job to end.

The runtime starts with the worker (``worker_init``: the model is loaded before the first
message is consumed) and stops after the pool has finished its tasks (``worker_shutdown``).
"""

from __future__ import annotations

from typing import Any

from celery import Task, signals
from redis.exceptions import RedisError

from common.settings import get_settings
from workers.celery_app import GENERATE_TASK, app
from workers.runtime import EngineRuntime, Outcome

RETRY_MARGIN_S = 0.5  # past the other worker's lease deadline

_runtime: EngineRuntime | None = None


@signals.worker_init.connect
def start_runtime(sender: Any, **_: Any) -> None:
    global _runtime
    settings = get_settings()
    _runtime = EngineRuntime.from_settings(settings, settings.worker_name or sender.hostname)


@signals.worker_shutdown.connect
def stop_runtime(**_: Any) -> None:
    if _runtime is not None:
        _runtime.close()


# NOTE: a Redis error (e.g. while taking the job) must not drop the message: the job would
# stay queued forever. Retry with backoff instead.
@app.task(
    name=GENERATE_TASK,
    bind=True,
    max_retries=None,
    autoretry_for=(RedisError,),
    retry_backoff=True,
    retry_backoff_max=30,
)
def generate(self: Task, job_id: str) -> None:
    if _runtime is None:
        raise RuntimeError("the engine runtime starts with the worker (worker_init); none is running")
    result = _runtime.run_job(job_id)
    if result.outcome is Outcome.BUSY:
        # Another worker runs it. Ask again when its lease would lapse: if that worker died,
        # this one takes the job over and resumes from the stored tokens.
        raise self.retry(countdown=result.retry_in_s + RETRY_MARGIN_S)
    if result.outcome is Outcome.SHUTDOWN:
        raise self.retry(countdown=get_settings().lease_s + RETRY_MARGIN_S)
