"""The Celery task: hands a job id to this process's EngineRuntime and waits for the job to end.

The runtime starts with the worker (``worker_init``: the model is loaded before the first
message is consumed) and stops after the pool has finished its tasks (``worker_shutdown``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, signals
from redis.exceptions import RedisError

from common.keys import GENERATE_TASK, REQUEUE_PRIORITY
from common.process import freeze_startup_objects
from common.settings import get_settings
from workers.celery_app import app
from workers.runtime import EngineRuntime, ModelLoadError, Outcome

log = logging.getLogger(__name__)

RETRY_MARGIN_S = 0.5  # past this worker's lease deadline
EXIT_MODEL_NOT_LOADED = 78  # EX_CONFIG: the worker's status when its model does not load

_runtime: EngineRuntime | None = None


def requeue(job_id: str) -> None:
    """Send a job's message again (the runtime's sweep found it orphaned: workers/reaper.py)."""
    app.send_task(GENERATE_TASK, args=[job_id], queue=get_settings().keys.queue_llm, priority=REQUEUE_PRIORITY)


@signals.worker_init.connect
def start_runtime(sender: Any, **_: Any) -> None:
    global _runtime
    settings = get_settings()
    try:
        _runtime = EngineRuntime.from_settings(settings, settings.worker_name or sender.hostname, requeue)
    except ModelLoadError as e:
        # NOTE: Celery logs what a worker_init handler raises and starts consuming anyway, with no
        # engine to run the jobs; SystemExit is no Exception, so it ends the worker here.
        log.critical("the worker exits with status %d before taking any job: %s", EXIT_MODEL_NOT_LOADED, e)
        raise SystemExit(EXIT_MODEL_NOT_LOADED) from e
    freeze_startup_objects()  # the model and the libraries: never scanned by a collection again


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
    # BUSY: a duplicate message (a requeue that raced the old worker's return, or the broker's
    # redelivery after its visibility timeout) while a live worker runs the job. Dropping it is
    # safe: should that worker die, the sweep (workers/reaper.py) sends the job again.
    if result.outcome is Outcome.SHUTDOWN:
        raise self.retry(countdown=get_settings().lease_s + RETRY_MARGIN_S)
