"""A worker's liveness, whatever runs its jobs: heartbeats, leases, cancels, abandoned jobs and the
sweep.

Two threads. The cancel listener aborts the jobs whose cancel is published on ``{p}:cancel``.
The heartbeat thread, every ``SPOOL_HEARTBEAT_S``, writes the worker's heartbeat and keeps its
tokenizer spec alive. It renews the leases of the jobs the executor holds and aborts those
another worker took over. It re-reads their cancel flags, cancels the foreground jobs nobody has
watched for ``SPOOL_DETACH_GRACE_S``, and sweeps for the jobs of dead workers (workers/reaper.py).

It knows nothing of the engine. An ``Executor`` gives the jobs it holds, a way to abort one and
its heartbeat's fields, so every kind of worker gets the same leases, fencing and take-over
(docs/internals.md#job-lifecycle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from redis.exceptions import RedisError

from common.keys import split_part_id
from common.process import NamedThread
from common.schemas.views import JobError, WorkerHeartbeat
from common.settings import Settings
from common.store import SyncJobStore
from common.store.cancels import listen_cancels
from workers.reaper import Reaper, Requeue

if TYPE_CHECKING:
    from common.prompt_tokens import TokenizerSpec

log = logging.getLogger(__name__)

# A foreground job's API process counts its client within this of creating it.
FIRST_WATCHER_S = 2.0


TOO_MANY_ATTEMPTS = "too_many_attempts"  # the error type of a job failed by SPOOL_MAX_ATTEMPTS


def too_many_attempts(attempt: int, settings: Settings) -> JobError | None:
    """The error of a job taken for the ``attempt``-th time, if that is past SPOOL_MAX_ATTEMPTS:
    each earlier attempt ended without the job (its worker died, stalled or lost it), so a job
    that kills its worker does not go on to kill every other one. None: run it."""
    if attempt <= settings.max_attempts:
        return None
    return JobError(
        message=f"the job was taken {attempt - 1} times (SPOOL_MAX_ATTEMPTS={settings.max_attempts}) "
        "and each time its worker died or lost it before it ended; it is not run again",
        type=TOO_MANY_ATTEMPTS,
    )


@dataclass(frozen=True)
class HeldJob:
    """A job an executor runs, as liveness sees it."""

    attempt: int  # the fencing token of the executor's writes
    needs_watcher: bool  # foreground and not already ending: aborted once nobody watches it


class Executor(Protocol):
    def held(self) -> Mapping[str, HeldJob]:
        """The jobs it runs now. Thread-safe."""
        ...

    def abort(self, job_id: str) -> None:
        """End a job it runs (a no-op for any other). Thread-safe."""
        ...

    def heartbeat_fields(self) -> dict[str, Any]:
        """The heartbeat's fields besides ``name`` and ``ts`` (common.schemas.views.WorkerHeartbeat)."""
        ...


class Liveness:
    def __init__(
        self,
        store: SyncJobStore,
        settings: Settings,
        name: str,
        executor: Executor,
        stop: threading.Event,
        requeue: Requeue | None,
        queue: str,
        embeds: bool = False,
    ) -> None:
        self.store = store
        self.settings = settings
        self.name = name  # the heartbeat's key and the job hashes' `worker`
        self.executor = executor
        self.stop = stop  # set when the worker stops
        # requeue sends a job's message again (the Celery app's send_task), and None means no sweep.
        # queue is the Celery queue of the jobs it sweeps for (its model's, or the media queue).
        # embeds: its model embeds (the sweep moves an unserved model's jobs only to its own kind).
        self._reaper = Reaper(store, name, requeue, queue, embeds) if requeue is not None else None
        self._connected_since: float | None = None  # start of the current run of successful beats
        self._tokenizer: TokenizerSpec | None = None  # named by the heartbeats (start)
        self._held_since: dict[str, float] = {}  # job id -> monotonic time a beat first saw it held
        # Held by a beat from reading the executor's jobs to renewing their leases. An executor
        # that lapses a lease takes it too, and lets go of the job under it first: a beat that
        # read the job before would otherwise renew the lapsed lease, and the job would wait a
        # whole lease for the sweep.
        self.leases = threading.Lock()
        self._threads = [
            NamedThread(target=self._listen_cancels, name="spool-cancels", daemon=True),
            NamedThread(target=self._beat, name="spool-heartbeat", daemon=True),
        ]

    def start(self, tokenizer: TokenizerSpec | None = None) -> None:
        """Beat once, then start the threads.

        The first beat runs before the worker takes a job, so it is ready at once. The jobs it ran
        before a restart are requeued ahead of the messages already queued, which its consumer
        would take first. Their leases are released first, since this process holds none.

        ``tokenizer``: the spec the API counts prompt tokens with (workers/tokenizer_spec.py),
        stored before the first heartbeat names it; every beat keeps it from expiring, so it goes
        once no live worker names it.
        """
        self._tokenizer = tokenizer
        try:
            if tokenizer is not None:
                self.store.put_tokenizer(tokenizer)
        except RedisError as e:
            log.warning("could not store the tokenizer for the API's token count (the beats will): %s", e)
        try:
            released = self.store.release_leases(self.name)
        except RedisError as e:
            log.warning("could not release the leases of an earlier run: %s", e)
        else:
            if released:
                log.info("requeueing %d job(s) of this worker's earlier run", len(released))
        self.beat_once()
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> None:
        """Wait for the threads to end once ``stop`` is set (the last beat removes the heartbeat)."""
        for t in self._threads:
            t.join(timeout=timeout)

    def forget_heartbeat(self) -> None:
        """Stop counting as ready now, rather than when the heartbeat's TTL ends."""
        try:
            self.store.remove_heartbeat(self.name)
        except RedisError:
            pass

    def _listen_cancels(self) -> None:
        # Cancels published while it reconnects are caught by the heartbeat's re-read of the flags.
        listen_cancels(self.store.redis, self.store.keys, self.executor.abort, self.stop)

    def _beat(self) -> None:
        while not self.stop.wait(self.settings.heartbeat_s):
            self.beat_once()
        self.forget_heartbeat()

    def beat_once(self) -> None:
        try:
            now = time.time()
            tokenizer = self._tokenizer.digest if self._tokenizer is not None else None
            heartbeat = WorkerHeartbeat(
                name=self.name, ts=now, tokenizer=tokenizer, **self.executor.heartbeat_fields()
            )
            self.store.beat(heartbeat, self._tokenizer)
            self._connected_since = self._connected_since or now
            with self.leases:
                held = self.executor.held()
                lost = self.store.renew_leases({j: h.attempt for j, h in held.items()})
            for job_id in lost:
                log.warning("lost the lease of job %s; dropping it", job_id)
                self.executor.abort(job_id)
            for job_id in self.store.cancel_requested(list(held)):
                self.executor.abort(job_id)
            for job_id in self._unwatched(held):
                self._cancel_unwatched(job_id)
            self._sweep(set(held), time.time() - self._connected_since >= self.settings.heartbeat_ttl_s)
        except RedisError as e:
            self._connected_since = None
            log.warning("heartbeat failed: %s", e)

    def _cancel_unwatched(self, job_id: str) -> None:
        split = split_part_id(job_id)
        if split is None:
            # No cancel flag needed: a worker that took the job over would find it unwatched too.
            log.info("cancelling foreground job %s: nobody has watched it for the grace", job_id)
            self.executor.abort(job_id)
            return
        # A part cancels its whole job, as the API's check would, and the job ends `cancelled`.
        # Its queued parts end at once and its running ones by their workers. This part ends too,
        # when the cancel reaches the listener or the next beat re-reads the flags.
        log.info(
            "cancelling foreground job %s of part %s: nobody has watched it for the grace", split[0], job_id
        )
        self.store.cancel_job(split[0])
        self.executor.abort(job_id)

    def _unwatched(self, held: Mapping[str, HeldJob]) -> list[str]:
        """The held jobs that nobody has watched for the grace (see store.unwatched).

        A job held for less than the grace (and than ``FIRST_WATCHER_S``) is left alone: its API
        process may not have counted its client yet, and one whose client left that soon is the
        API's own check's to cancel.
        """
        # NOTE: how long it is held, on this process's monotonic clock: the job's created_at is
        # the API's clock, and a worker's clock ahead of it would check a job before its API
        # counted the client. The watchers are counted on Redis's clock (store.unwatched).
        now = time.monotonic()
        self._held_since = {j: self._held_since.get(j, now) for j in held}
        young = now - max(self.settings.detach_grace_s, FIRST_WATCHER_S)
        jobs = [j for j, h in held.items() if h.needs_watcher and self._held_since[j] <= young]
        return self.store.unwatched(jobs, self.settings.detach_grace_s) if jobs else []

    def _sweep(self, mine: set[str], others_too: bool) -> None:
        if self._reaper is None or self.stop.is_set():
            return
        try:
            self._reaper.sweep(mine, others_too)
        except RedisError:
            raise
        except Exception:  # e.g. the broker refused the message: the claim lapses, the next sweep retries
            log.exception("sweep for orphaned jobs failed")
