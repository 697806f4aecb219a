"""What the task modules of every kind of worker share (workers/tasks.py, workers/media/tasks.py,
workers/hooks/tasks.py): starting the runtime in ``worker_init`` or exiting before any job, a
task's outcome and its retries. It imports no engine: a media or hook worker loads none.

Start-up, exits and take-overs: docs/internals.md#job-lifecycle.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from celery import Celery, signals
from redis.exceptions import RedisError

from common.process import freeze_startup_objects
from common.settings import Settings
from common.store import SyncJobStore
from common.store.clients import answers
from workers.identity import NameHeld, claim_name, default_worker_name

log = logging.getLogger(__name__)

RETRY_MARGIN_S = 0.5  # a task that met the worker's shutdown runs again this long past its lease
EXIT_CANNOT_SERVE = 78  # EX_CONFIG: its model does not load, or its name is another live worker's
EXIT_STOPPED_WITHOUT_REDIS = 75  # EX_TEMPFAIL: told to stop, Redis unreachable for SPOOL_STOP_TIMEOUT_S
STOP_PING_S = 0.5  # how often a stopping worker asks whether Redis answers (and a ping's timeout)

# NOTE: a Redis error (e.g. while taking the job) must not drop the message: the job would
# stay queued forever. Retry with backoff instead.
TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "max_retries": None,
    "autoretry_for": (RedisError,),
    "retry_backoff": True,
    "retry_backoff_max": 30,
}


class _Closes(Protocol):
    def close(self) -> None: ...


Runtime = TypeVar("Runtime")
Closes = TypeVar("Closes", bound=_Closes)


class Outcome(str, enum.Enum):
    """What became of a job (or image part) a task handed to its worker's runtime."""

    FINISHED = "finished"  # this worker wrote the job's terminal event
    LOST = "lost"  # another worker took the job over; this one stopped writing
    SKIPPED = "skipped"  # nothing to do: already finished, cancelled while queued, or unknown
    BUSY = "busy"  # another worker runs it under a live lease (a duplicate message)
    SHUTDOWN = "shutdown"  # the worker stopped first; the job's lease lapses and another takes it


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


class RuntimeHolder(Generic[Closes]):
    """Holds the one runtime of a worker process (an EngineRuntime, MediaRuntime or HookRuntime):
    started by ``worker_init`` (``start_or_exit``) when the worker is ``app``'s, closed at
    ``worker_shutdown``; a task reaches it with ``get``."""

    def __init__(self, app: Celery, settings: Settings, start: Callable[[str], Closes], kind: str) -> None:
        self.app = app
        self.kind = kind  # "engine", "media", "hook": named in the error of a task that finds none
        self._settings = settings
        self._start = start
        self._runtime: Closes | None = None
        signals.worker_init.connect(self._on_init, weak=False)
        signals.worker_shutting_down.connect(self._on_shutting_down, weak=False)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False)

    def _on_shutting_down(self, **_: Any) -> None:
        if self._runtime is not None:
            StopBound(self._settings).start()

    def _on_init(self, sender: Any, **_: Any) -> None:
        if sender.app is self.app:  # a process that imported another kind's tasks starts only its own
            self._runtime = start_or_exit(self._settings, self._start)

    def _on_shutdown(self, **_: Any) -> None:
        if self._runtime is not None:
            self._runtime.close()

    def get(self) -> Closes:
        if self._runtime is None:
            raise RuntimeError(
                f"the {self.kind} runtime starts with the worker (worker_init); none is running"
            )
        return self._runtime


class StopBound:
    """Bounds a worker's stop while Redis is unreachable.

    Told to stop (SIGTERM: Celery's warm shutdown), a worker finishes its running jobs before it
    exits. Their ends are writes to Redis, so with Redis unreachable it would wait for good (a
    task thread on its job, the writer retrying). A thread started at the signal asks Redis every
    ``STOP_PING_S``; once no answer came for ``SPOOL_STOP_TIMEOUT_S`` (from the signal, or from the
    last answer), it says so in the log and ends the process with ``EXIT_STOPPED_WITHOUT_REDIS``.
    Nothing is lost: the jobs' leases lapse in Redis, and another worker (or this one, restarted)
    takes them over from their logged tokens once Redis is back. While Redis answers, the stop
    waits for the jobs as before.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._urls = sorted({settings.redis_url, settings.broker_redis_url})  # either one gone stops it

    def start(self) -> None:
        threading.Thread(target=self._run, name="spool-stop-bound", daemon=True).start()

    def _run(self) -> None:
        limit = self._settings.stop_timeout_s
        answered = time.monotonic()
        while True:
            if all(answers(url, STOP_PING_S) for url in self._urls):
                answered = time.monotonic()
            elif time.monotonic() - answered >= limit:
                break
            time.sleep(STOP_PING_S)  # a poll's pace, not a wait for a condition
        log.critical(
            "told to stop with Redis unreachable for %.0f s (SPOOL_STOP_TIMEOUT_S): exiting with "
            "status %d without finishing the running jobs; their leases lapse and other workers "
            "take them over once Redis is back",
            limit,
            EXIT_STOPPED_WITHOUT_REDIS,
        )
        logging.shutdown()
        os._exit(
            EXIT_STOPPED_WITHOUT_REDIS
        )  # Celery's stop waits on the jobs' threads: nothing can join them
