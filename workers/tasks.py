"""The Celery task: hands a job id to this process's EngineRuntime and waits for the job to end.

The runtime starts with the worker (``worker_init``: the model is loaded before the first
message is consumed) and stops after the pool has finished its tasks (``worker_shutdown``).

A job's way through the worker: docs/internals.md#the-path-of-one-token.
"""

from __future__ import annotations

from celery import Task

from common.keys import GENERATE_TASK, REQUEUE_PRIORITY
from common.settings import get_settings
from workers.celery_app import app, worker_concurrency
from workers.runtime import EngineRuntime
from workers.task_common import RETRY_MARGIN_S, TASK_OPTIONS, Outcome, RuntimeHolder


def requeue(job_id: str) -> None:
    """Send a job's message again, to this worker's model's queue (the runtime's sweep found it
    orphaned: workers/reaper.py, which requeues only the jobs of that queue)."""
    settings = get_settings()
    queue = settings.keys.model_queue(settings.served_model)
    app.send_task(GENERATE_TASK, args=[job_id], queue=queue, priority=REQUEUE_PRIORITY)


_settings = get_settings()
_runtime = RuntimeHolder(
    app,
    _settings,
    lambda name: EngineRuntime.from_settings(_settings, name, requeue, worker_concurrency(_settings)),
    "engine",
)


@app.task(name=GENERATE_TASK, **TASK_OPTIONS)  # type: ignore[untyped-decorator]  # celery has no types; Redis errors retried, never dropped
def generate(self: Task, job_id: str) -> None:
    outcome = _runtime.get().run_job(job_id)
    # BUSY: a duplicate message (a requeue that raced the old worker's return, or the broker's
    # redelivery after its visibility timeout) while a live worker runs the job. Dropping it is
    # safe: should that worker die, the sweep (workers/reaper.py) sends the job again.
    if outcome is Outcome.SHUTDOWN:
        raise self.retry(countdown=get_settings().lease_s + RETRY_MARGIN_S)
