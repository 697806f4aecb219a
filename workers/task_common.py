"""What the task modules of every kind of worker share (workers/tasks.py, workers/media/tasks.py):
starting the runtime in ``worker_init`` or exiting before any job, and the task's retries."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from common.process import freeze_startup_objects
from common.settings import Settings
from common.store import SyncJobStore
from workers.identity import NameHeld, claim_name, default_worker_name

log = logging.getLogger(__name__)

RETRY_MARGIN_S = 0.5  # a task that met the worker's shutdown runs again this long past its lease
EXIT_CANNOT_SERVE = 78  # EX_CONFIG: its model does not load, or its name is another live worker's

# NOTE: a Redis error (e.g. while taking the job) must not drop the message: the job would
# stay queued forever. Retry with backoff instead.
TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "max_retries": None,
    "autoretry_for": (RedisError,),
    "retry_backoff": True,
    "retry_backoff_max": 30,
}

Runtime = TypeVar("Runtime")


class ModelLoadError(RuntimeError):
    """The worker's model did not load: it cannot serve, and must not take jobs."""


def claim(settings: Settings, name: str) -> None:
    """Refuse a name another live worker holds (NameHeld); with Redis unreachable, go on unchecked."""
    store = SyncJobStore.from_settings(settings)
    try:
        claim_name(store, name)
    except RedisError as e:
        log.warning("could not check that no live worker holds the name %r: %s", name, e)
    finally:
        store.close()


def start_or_exit(settings: Settings, start: Callable[[str], Runtime]) -> Runtime:
    """Claim the worker's name and ``start(name)`` its runtime, for a ``worker_init`` handler;
    SystemExit(EXIT_CANNOT_SERVE) when either fails."""
    # NOTE: Celery logs what a worker_init handler raises and starts consuming anyway; SystemExit
    # is no Exception, so it ends a worker that cannot serve here, before it takes any job.
    # Celery sets its logging up after worker_init: until then the runtime's INFO lines (the KV
    # cache's size, the compile's time) would go nowhere. Celery replaces this handler later.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/%(processName)s] %(message)s")
    try:
        name = settings.worker_name or default_worker_name()
        claim(settings, name)
        runtime = start(name)
    except (NameHeld, ModelLoadError) as e:
        log.critical("the worker exits with status %d before taking any job: %s", EXIT_CANNOT_SERVE, e)
        raise SystemExit(EXIT_CANNOT_SERVE) from e
    except Exception as e:
        log.critical("the worker could not start; exiting with status %d", EXIT_CANNOT_SERVE, exc_info=True)
        raise SystemExit(EXIT_CANNOT_SERVE) from e
    freeze_startup_objects()  # the model and the libraries: never scanned by a collection again
    return runtime
