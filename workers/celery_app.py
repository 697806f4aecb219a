"""The Celery app of the workers. Results live in the job store, so there is no result backend."""

from __future__ import annotations

import os
import re
import socket

from celery import Celery

from common.keys import GENERATE_TASK, MEDIA_TASK
from common.settings import Settings, get_settings
from workers.broker import TRANSPORT

SPARE_TASK_THREADS = 4  # beyond one per batch slot: tasks that only find a job busy or finished
# An unacknowledged message is handed out again after this long. It is only the last resort:
# the job of a worker that died (SIGKILL, lost machine) is found by the other workers' sweeps
# within a lease (SPOOL_LEASE_S, workers/reaper.py) and requeued; a redelivered message whose
# job is running or finished meanwhile is dropped (workers/tasks.py).
VISIBILITY_TIMEOUT_S = 3600


def worker_concurrency(settings: Settings) -> int:
    return settings.max_batch_size + SPARE_TASK_THREADS


def node_name(kind: str, model: str) -> str:
    """The worker's Celery node name, ``{kind}-{model}-{pid}@{host}``: unique per process, so
    ``celery inspect`` and Flower tell each worker apart (Celery's default is ``celery@{host}``
    for all of them). ``model``: its last path component, in the characters a node name allows."""
    short = re.sub(r"[^A-Za-z0-9_.-]+", "-", model.rstrip("/").rsplit("/", 1)[-1]) or "default"
    return f"{kind}-{short}-{os.getpid()}@{socket.gethostname()}"


def make_app(
    settings: Settings,
    include: tuple[str, ...] = ("workers.tasks",),
    queue: str | None = None,
    concurrency: int | None = None,
) -> Celery:
    """The workers' Celery app: text workers' by default, on the queue of the model they serve
    (``Keys.model_queue``); a media worker's names its own task module, queue (``{p}.media``) and
    concurrency (workers/media/tasks.py)."""
    text_queue = settings.keys.model_queue(settings.served_model)
    queue = queue or text_queue
    # The broker's Redis: SPOOL_BROKER_URL, or the job data's (common/store/outbox.py).
    app = Celery("spool", broker=settings.broker_redis_url, include=list(include))
    app.conf.update(
        task_ignore_result=True,
        # A job's message is acknowledged when its task returns, and given back if the worker
        # process dies, so no job is lost with a worker.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue,
        # Celery's defaults ("celery", "celeryev") would be shared by every prefix on the Redis.
        control_exchange=settings.keys.control_exchange,
        event_exchange=settings.keys.event_exchange,
        task_routes={
            GENERATE_TASK: {"queue": text_queue},
            MEDIA_TASK: {"queue": settings.keys.queue_media},
        },
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S, **settings.keys.broker_unacked},
        # Redis, without the restore that kills the worker when Redis restarts (workers/broker.py).
        broker_transport=TRANSPORT,
        broker_connection_retry_on_startup=True,
        # NOTE: CUDA is not fork-safe and the engine must be one per process: threads, no fork.
        worker_pool="threads",
        worker_concurrency=concurrency or worker_concurrency(settings),
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_send_task_events=settings.task_events,
    )
    return app


app = make_app(get_settings())
