"""The media workers' Celery app and task: hands an image part to this process's MediaRuntime.

Its own app, on the ``{p}.media`` queue with one task thread: a worker runs one pipeline, one
image at a time. The runtime starts with the worker (``worker_init``: the pipeline is loaded
before the first message is consumed) and stops with it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, signals
from redis.exceptions import RedisError

from common.keys import MEDIA_TASK, REQUEUE_PRIORITY
from common.process import freeze_startup_objects
from common.settings import get_settings
from common.store import SyncJobStore
from workers.celery_app import make_app
from workers.identity import claim_name, default_worker_name
from workers.media.runtime import MediaRuntime
from workers.runtime import Outcome

log = logging.getLogger(__name__)

RETRY_MARGIN_S = 0.5  # past this worker's lease deadline (as workers/tasks.py)
EXIT_CANNOT_SERVE = 78  # as workers/tasks.py: its pipeline does not load, or its name is held

_settings = get_settings()
app = make_app(_settings, include=(), queue=_settings.keys.queue_media, concurrency=1)

_runtime: MediaRuntime | None = None


def requeue(part_id: str) -> None:
    """Send a part's message again (the sweep found it orphaned: workers/reaper.py)."""
    app.send_task(MEDIA_TASK, args=[part_id], queue=_settings.keys.queue_media, priority=REQUEUE_PRIORITY)


def claim(name: str) -> None:
    """Refuse a name another live worker holds (NameHeld); with Redis unreachable, go on unchecked."""
    store = SyncJobStore.from_settings(_settings)
    try:
        claim_name(store, name)
    except RedisError as e:
        log.warning("could not check that no live worker holds the name %r: %s", name, e)
    finally:
        store.close()


@signals.worker_init.connect
def start_runtime(sender: Any, **_: Any) -> None:
    global _runtime
    if sender.app is not app:
        return
    # As a text worker's (workers/tasks.py): SystemExit ends a worker that cannot serve before it
    # takes any part (Celery logs what else a worker_init handler raises and consumes anyway).
    try:
        name = _settings.worker_name or default_worker_name()
        claim(name)
        _runtime = MediaRuntime.from_settings(_settings, name, requeue)
    except Exception as e:
        log.critical(
            "the media worker could not start; exiting with status %d", EXIT_CANNOT_SERVE, exc_info=True
        )
        raise SystemExit(EXIT_CANNOT_SERVE) from e
    freeze_startup_objects()


@signals.worker_shutdown.connect
def stop_runtime(**_: Any) -> None:
    if _runtime is not None:
        _runtime.close()


@app.task(
    name=MEDIA_TASK,
    bind=True,
    max_retries=None,
    autoretry_for=(RedisError,),
    retry_backoff=True,
    retry_backoff_max=30,
)
def generate_image(self: Task, part_id: str) -> None:
    if _runtime is None:
        raise RuntimeError("the media runtime starts with the worker (worker_init); none is running")
    if _runtime.run_part(part_id) is Outcome.SHUTDOWN:
        raise self.retry(countdown=_settings.lease_s + RETRY_MARGIN_S)
