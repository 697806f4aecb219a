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
from common.store import SyncJobStore
from workers.celery_app import app
from workers.identity import NameHeld, claim_name, default_worker_name
from workers.runtime import EngineRuntime, ModelLoadError, Outcome

log = logging.getLogger(__name__)

RETRY_MARGIN_S = 0.5  # past this worker's lease deadline
EXIT_CANNOT_SERVE = 78  # EX_CONFIG: its model does not load, or its name is another live worker's

_runtime: EngineRuntime | None = None


def requeue(job_id: str) -> None:
    """Send a job's message again (the runtime's sweep found it orphaned: workers/reaper.py)."""
    app.send_task(
        GENERATE_TASK, args=[job_id], queue=get_settings().keys.queue_llm, priority=REQUEUE_PRIORITY
    )


def claim(name: str) -> None:
    """Refuse a name another live worker holds (NameHeld); with Redis unreachable, go on unchecked."""
    store = SyncJobStore.from_settings(get_settings())
    try:
        claim_name(store, name)
    except RedisError as e:
        log.warning("could not check that no live worker holds the name %r: %s", name, e)
    finally:
        store.close()


@signals.worker_init.connect
def start_runtime(sender: Any, **_: Any) -> None:
    global _runtime
    settings = get_settings()
    # NOTE: Celery logs what a worker_init handler raises and starts consuming anyway; SystemExit
    # is no Exception, so it ends a worker that cannot serve here, before it takes any job.
    try:
        name = settings.worker_name or default_worker_name()
        claim(name)
        _runtime = EngineRuntime.from_settings(settings, name, requeue)
    except (NameHeld, ModelLoadError) as e:
        log.critical("the worker exits with status %d before taking any job: %s", EXIT_CANNOT_SERVE, e)
        raise SystemExit(EXIT_CANNOT_SERVE) from e
    except Exception as e:
        log.critical("the worker could not start; exiting with status %d", EXIT_CANNOT_SERVE, exc_info=True)
        raise SystemExit(EXIT_CANNOT_SERVE) from e
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
    outcome = _runtime.run_job(job_id)
    # BUSY: a duplicate message (a requeue that raced the old worker's return, or the broker's
    # redelivery after its visibility timeout) while a live worker runs the job. Dropping it is
    # safe: should that worker die, the sweep (workers/reaper.py) sends the job again.
    if outcome is Outcome.SHUTDOWN:
        raise self.retry(countdown=get_settings().lease_s + RETRY_MARGIN_S)
