"""The engine runtime: one Engine per worker process, driven by one thread. This is the token path.

Celery task threads call ``run_job`` and block until their job's terminal event is written.
Only the engine thread touches the engine. It applies the inbox's commands (add, abort), runs
``engine.step()`` and hands the step's log entries to the writer thread. The writer writes them
in one round trip while the engine runs the next step, so the engine waits for Redis only when
the writer is ``OUTBOX_STEPS`` steps behind. While the worker holds batch lines, an intake thread
takes queued interactive jobs itself, since Celery hands it no message until a line ends; while
all of Celery's task threads are busy, one more runs the messages of tenants it holds no job of
(workers/tenant_intake.py).

What the engine thread does to a job is in workers/core.py, a job's record in workers/job.py.
The runtime is the executor of workers/liveness.py. The path of a token through it:
docs/internals.md#the-path-of-one-token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from redis.exceptions import RedisError

from common.keys import Keys
from common.process import NamedThread
from common.schemas.views import JobError
from common.settings import Settings
from common.store import Append, SyncJobStore, TakeStatus
from common.store.broker_lists import BrokerLists
from common.tenants import tenant_of
from workers.appends import prepare_appends
from workers.core import JobCore
from workers.engine import Delta, Engine
from workers.engine.embedder import EmbeddingEngine
from workers.identity import this_process
from workers.job import Job, compile_guide, new_job, prompt_of, timeout_error
from workers.liveness import HeldJob, Liveness
from workers.loader import load_engine, tool_parser_of
from workers.metrics import WorkerMetrics, job_sets, per_job
from workers.publisher import OUTBOX_STEPS, Outbox, Publisher, write_steps
from workers.reaper import Requeue
from workers.task_common import Outcome
from workers.tenant_intake import TenantIntake
from workers.tokenizer_spec import served_spec
from workers.watchdog import Watchdog

log = logging.getLogger(__name__)

INTAKE_S = 0.02  # how often a worker holding batch lines looks for queued interactive jobs


@dataclass(frozen=True)
class _Add:
    job_id: str


@dataclass(frozen=True)
class _Abort:
    job_id: str
    error: JobError | None  # None: a client cancel (status cancelled); else the job fails with it


@dataclass(frozen=True)
class _Drop:
    job_id: str  # another worker took it over, or it is handed back: stop it, write nothing more
    job: Job | None  # its record, read before it is released (which may come first)


_STOP = object()


class EngineRuntime:
    def __init__(
        self,
        engine: Engine,
        store: SyncJobStore,
        settings: Settings,
        name: str,
        model: str,
        requeue: Requeue | None = None,
        task_threads: int | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.name = name  # heartbeat key and the job hash's `worker`
        self.model = model  # shown in heartbeats and jobs
        self.queue = settings.keys.model_queue(model)  # the only queue it takes jobs from
        self.metrics = WorkerMetrics(model)  # observed on the engine thread (workers/metrics.py)
        self._tool_parser = tool_parser_of(engine.tokenizer, settings.tool_parser)
        self._stop = threading.Event()
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Drop | object] = queue.SimpleQueue()
        # One list of log entries per step; None after the last.
        self._outbox: Outbox = queue.Queue(maxsize=OUTBOX_STEPS)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()  # guards _jobs: task threads add, the engine thread removes
        self._stats: dict[str, Any] = engine.stats()  # engine thread writes, heartbeat reads
        self._core = JobCore(engine, settings, self.metrics, model)  # called on the engine thread only
        self._publisher = Publisher(store, self._stop)
        self.liveness = Liveness(
            store, settings, name, self, self._stop, requeue, self.queue, isinstance(engine, EmbeddingEngine)
        )
        self._watchdog = Watchdog(settings.engine_stall_s, self._stop, self.liveness.forget_heartbeat)
        self._intaking: set[str] = set()  # jobs the intake thread found queued, being taken (under _lock)
        self._threads = [
            NamedThread(target=self._engine_loop, name="spool-engine", daemon=True),
            NamedThread(
                target=write_steps, args=(self._outbox, self._write), name="spool-writer", daemon=True
            ),
            NamedThread(target=self._intake_loop, name="spool-intake", daemon=True),
        ]
        # Celery's task threads (its concurrency): while all are busy, one more thread runs the
        # messages of tenants it holds no job of. None (no Celery, as in tests): no such thread.
        self._tenants = TenantIntake(
            BrokerLists(store.broker), self.queue, self.held_queues, self._run, task_threads, self._stop
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, name: str, requeue: Requeue | None = None, task_threads: int | None = None
    ) -> EngineRuntime:
        """Load the model, beat once and start the threads."""
        engine = load_engine(settings)
        store = SyncJobStore.from_settings(settings)
        runtime = cls(engine, store, settings, name, settings.served_model, requeue, task_threads)
        if settings.worker_metrics_port is not None:
            runtime.metrics.serve(settings.worker_metrics_port)
        runtime.start()
        return runtime

    def start(self) -> None:
        # Liveness beats once first: the worker is ready before Celery consumes a message. Its
        # heartbeats name the tokenizer spec: the API checks requests' lengths from then on.
        self.liveness.start(served_spec(self.engine.tokenizer, prompt_of))
        for t in self._threads:
            t.start()
        self._tenants.start()
        self._watchdog.start()

    def close(self) -> None:
        """Stop the threads; jobs still running are released with Outcome.SHUTDOWN."""
        self._stop.set()
        self._inbox.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)
        self._tenants.join(timeout=10)
        self.liveness.join(timeout=10)
        self._watchdog.join(timeout=10)
        with self._lock:
            for job in self._jobs.values():
                job.done.set()
        self.store.close()

    # -- task threads ----------------------------------------------------------------------------

    def run_job(self, job_id: str) -> Outcome:
        """Take the job, run it, and return once its terminal event is written (or it was lost).
        For Celery's task threads (counted: workers/tenant_intake.py); the intakes call ``_run``."""
        with self._tenants.task():
            return self._run(job_id)

    def _run(self, job_id: str) -> Outcome:
        if self._stop.is_set():
            return Outcome.SHUTDOWN
        taken = self.store.take_job(job_id, self.name, self.model)
        if taken.status is TakeStatus.BUSY:
            return Outcome.BUSY
        if taken.status is not TakeStatus.TAKEN:
            return Outcome.SKIPPED
        job = new_job(taken)
        with self._lock:
            self._jobs[job_id] = job  # held from now on: its lease is renewed while it compiles
        # Compiled on this task thread (or read from the cache), so a new schema never stalls the
        # engine's batch.
        compile_guide(job, self.engine.grammars, self._tool_parser)
        if taken.record is not None and taken.record.cancel_requested:
            self._inbox.put(_Abort(job_id, None))  # cancelled while an earlier attempt ran it
        self._inbox.put(_Add(job_id))
        if not job.batch_line:  # a step of lower priorities in flight stops for it (Engine.interrupt)
            self.engine.interrupt(job.request.priority)
        job.done.wait()
        return job.outcome

    def abort(self, job_id: str, error: JobError | None = None) -> None:
        """Thread-safe: end a job this worker runs (no-op for other jobs)."""
        with self._lock:
            ours = job_id in self._jobs
        if ours:
            self._inbox.put(_Abort(job_id, error))

    def job_ids(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    # -- the intake thread ------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        """Take queued interactive jobs while this worker holds batch lines.

        Celery reserves a message for each task thread; with every thread holding a line (in the
        engine or waiting for a slot), an interactive message waits in the queue until some line
        ends, however far ahead of the lines it is queued (with lines of one length that is the
        end of a whole wave of them). So every ``INTAKE_S`` a worker that holds a line reads the
        oldest queued jobs of its model (the queued set holds interactive jobs and text parts, never lines)
        and runs each as its message would, on a thread of its own, as many as its engine has
        slots not held by interactive jobs: the engine preempts a line for it at the next step.
        The take is the same script (one worker wins it); the message, delivered later, finds
        the job running or ended and is dropped (``Outcome.BUSY`` / ``SKIPPED``).
        """
        while not self._stop.wait(INTAKE_S):
            room = self._intake_room()
            if room <= 0:
                continue
            try:
                queued = self.store.oldest_queued(room, self.queue)
            except RedisError:
                continue  # Redis unreachable: the messages still come through Celery
            with self._lock:
                new = [j for j in queued if j not in self._jobs and j not in self._intaking]
                self._intaking.update(new)
            for job_id in new:
                NamedThread(target=self._intake, args=(job_id,), name="spool-intake-job", daemon=True).start()

    def _intake_room(self) -> int:
        with self._lock:
            lines = sum(j.batch_line for j in self._jobs.values())
            # Engine requests of interactive jobs (one per choice), and those being taken.
            interactive = sum(len(j.choices) for j in self._jobs.values() if not j.batch_line)
            interactive += len(self._intaking)
        return self.engine.num_slots - interactive if lines else 0

    def _intake(self, job_id: str) -> None:
        try:
            self._run(job_id)
        except RedisError as e:  # its message, still queued, runs it
            log.warning("intake of job %s: %s", job_id, e)
        except Exception:
            log.exception("intake of job %s failed", job_id)
        finally:
            with self._lock:
                self._intaking.discard(job_id)

    # -- the executor of workers/liveness.py ------------------------------------------------------

    def held(self) -> dict[str, HeldJob]:
        with self._lock:
            return {
                job_id: HeldJob(j.cursor.attempt, not j.request.background and not j.abort_requested)
                for job_id, j in self._jobs.items()
            }

    def held_queues(self) -> set[str]:
        """The tenant queues of the held jobs' tenants (Keys.tenant_queue)."""
        with self._lock:
            return {Keys.tenant_queue(self.queue, tenant_of(j.owner)) for j in self._jobs.values()}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {
            "engine": self._stats,
            "model": self.model,
            "chat_template": bool(self.engine.tokenizer.chat_template),
            "tool_parser": self._tool_parser,
            "max_model_len": self.engine.max_model_len,
            # The sizes its embeddings come in (the full size first); None: it generates text.
            "embedding_dimensions": (
                list(self.engine.embedder.dimensions) if isinstance(self.engine, EmbeddingEngine) else None
            ),
            **asdict(this_process()),
        }

    # -- the engine thread -----------------------------------------------------------------------

    def _engine_loop(self) -> None:
        while self._drain_inbox(block=not self.engine.has_unfinished() and not self._core.has_pending()):
            try:
                self._expire()
                started = time.time()
                stepped = self._step() if self.engine.has_unfinished() else []
                embedded, ended = (
                    self._core.embeddings.run() if self._core.embeddings.has_waiting() else ([], [])
                )
                deltas = ended + self._core.take_pending() + stepped  # after the step: kept if it raised
                self._stats = self.engine.stats()
                with self._lock:
                    cursors = {eid: j.cursor for j in self._jobs.values() for eid in j.engine_ids}
                self._core.end_siblings(deltas, cursors, self._job)
                appends = embedded + prepare_appends(deltas, cursors)
                jobs_running, jobs_waiting = job_sets(*self.engine.request_ids(), cursors)
                counts = {"running": len(jobs_running), "waiting": len(jobs_waiting)}
                self.metrics.step(
                    started, per_job(deltas, cursors), appends, {**self._stats, **counts}, jobs_waiting
                )
                if appends:
                    self._outbox.put(appends)  # waits while the writer is OUTBOX_STEPS behind
            except Exception:
                log.exception("engine loop error; going on")
        self._outbox.put(None)

    def _step(self) -> list[Delta]:
        with self._watchdog.step():
            return self.engine.step()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command, first waiting for one if ``block``; False on stop."""
        # NOTE: blocking without a timeout is safe: deadlines only matter for jobs in the engine,
        # and while the engine has work this never blocks.
        try:
            cmd = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while cmd is not _STOP:
            if isinstance(cmd, _Add):
                job = self._job(cmd.job_id)
                assert job is not None  # only the engine thread removes jobs, after their last event
                self._core.add(job)
            elif isinstance(cmd, _Abort):
                self._core.abort(self._job(cmd.job_id), cmd.error)
            elif isinstance(cmd, _Drop):
                self._core.drop(cmd.job_id, cmd.job)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _job(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def _expire(self) -> None:
        now = time.time()
        with self._lock:
            late = [j for j in self._jobs.values() if j.in_engine and j.deadline and j.deadline <= now]
        for job in late:
            self._core.abort(self._job(job.cursor.job_id), timeout_error(job))  # None: released meanwhile

    # -- the writer thread -----------------------------------------------------------------------

    def _write(self, appends: list[Append]) -> None:
        try:
            sent = self._publisher.send(appends)  # retries while Redis is unreachable or refuses writes
        except RedisError:
            if not self._stop.is_set():  # at shutdown the leases lapse instead
                # This is no refusal that passes. A gap follows, and _hand_back resumes the jobs.
                log.exception("could not write the step's events")
            return
        for job_id in sent.lost:
            log.warning("job %s was taken over by another worker; dropping it", job_id)
            self._inbox.put(_Drop(job_id, self._job(job_id)))
        self._hand_back(sent.gaps - sent.lost)
        self._release(sent.finished, Outcome.FINISHED)
        self._release(sent.lost, Outcome.LOST)

    def _hand_back(self, gaps: set[str]) -> None:
        """Jobs whose log has a gap before this worker's next event (one of its writes was lost):
        not a take-over (the attempt is still ours). What is stored is consistent, what the engine
        holds is not, so stop them and lapse their leases: the sweep requeues them and the worker
        that takes them resumes from the stored tokens, with the text an unbroken run gives.

        They are released before their leases lapse, under liveness's lease lock, so no beat
        renews a lease after it lapsed (one that read them held finishes its renewal first)."""
        if not gaps:
            return
        with self.liveness.leases:
            with self._lock:
                jobs = {job_id: job for job_id in gaps if (job := self._jobs.pop(job_id, None))}
            for job_id, job in jobs.items():
                log.error(
                    "job %s: its log has a gap before this worker's next event; handing it back", job_id
                )
                self._inbox.put(_Drop(job_id, job))
            try:
                self.store.lapse_leases({job_id: job.cursor.attempt for job_id, job in jobs.items()})
            except RedisError as e:  # its lease then lapses unrenewed (this worker no longer holds it)
                log.warning("could not lapse the leases of %s: %s", sorted(jobs), e)
        for job in jobs.values():
            job.outcome = Outcome.LOST
            job.done.set()

    def _release(self, job_ids: set[str], outcome: Outcome) -> None:
        with self._lock:
            # A lost job's entries of later steps may already have been handed over; they are
            # refused too, and it is released once.
            jobs = [job for job_id in job_ids if (job := self._jobs.pop(job_id, None))]
        for job in jobs:
            job.outcome = outcome
            job.done.set()
