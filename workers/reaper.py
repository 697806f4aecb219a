"""Finds the jobs nobody runs any more and sends their messages again, so another worker takes them.

Every live worker runs a sweep from its heartbeat thread, so recovery needs no extra process:

- A running job whose lease lapsed (its worker stopped renewing it: killed, frozen, cut off) and
  whose worker has no live heartbeat is requeued. The take-over then happens in ``take_job``
  (attempt + 1 fences the old worker out) and the runtime resumes from the stored tokens. A job
  whose worker is this very one, restarted (same name), is requeued without waiting for the
  heartbeat, since this process knows it does not run it.
- A queued job that has waited longer than a lease while the Celery queue is empty lost its
  message (Redis went down as a worker received it, or restarted without it): it is sent again.
  Text jobs and text parts are found in ``{p}:queued``, image parts (once their message was
  sent) in ``{p}:queued_media``; each kind of worker sweeps its own. (The API cannot lose it:
  the script that stores a job pushes its message.)

A job's hash names its Celery queue (``queue``: its model's, ``Keys.model_queue``), and a sweep
requeues only the jobs of the queue it was given, to that queue: a text worker's, its model's, so
a job is taken over by a worker of the model it was queued for, never by another model's.

Celery's visibility timeout would also redeliver a dead worker's message, but only after it
expires (minutes, and it must exceed the longest job); the sweep acts within a lease.
``claim_requeue`` (one Lua call) makes exactly one worker send each requeue, and duplicates are
harmless anyway: a second message finds the job running or finished and is dropped.

The messages a dead worker held stay in kombu's unacknowledged records (``{p}.unacked`` and its
index) until the visibility timeout (an hour) restores them: each restored message finds its job
ended (or expired), does nothing, and is acknowledged, which removes its record. Workers killed
often would pile records up for that hour (117 after 7 kills), so once a lease the sweep drops the
records of jobs that have ended or expired itself (``drop_ended_deliveries``); a record of a job
still running or queued stays, for the restore as a last resort.

``{p}:attempts`` (the fencing of text jobs' appends) loses a job's field with its last append. A
job whose hash went while it ran (lost, deleted, expired) never makes that append and would keep
its field for good. So the text workers' sweep goes through the hash in pages, one page of
``ATTEMPTS_PAGE`` fields per sweep and a pass at most once a lease, and drops the fields of jobs
that no longer run (``drop_stale_attempts``).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from common.store import SyncJobStore

log = logging.getLogger(__name__)

Requeue = Callable[[str], None]  # sends the job's task message (Celery's send_task, by name)
ATTEMPTS_PAGE = 200  # fields of {p}:attempts read (HSCAN's COUNT) and checked per sweep


@dataclass(frozen=True)
class Requeued:
    job_id: str
    reason: str  # "lease lapsed" | "message lost"
    previous_worker: str  # the worker whose lease lapsed; empty for a queued job


class Reaper:
    def __init__(self, store: SyncJobStore, name: str, requeue: Requeue, queue: str) -> None:
        self.store = store
        self.name = name  # this worker's name, as in the job hashes' `worker`
        self.requeue = requeue
        # The jobs it requeues: those of its own Celery queue (its model's, or {p}.media); a media
        # worker's sweep leaves text jobs to text workers, and a text worker's other models' jobs.
        self.queue = queue
        self.text = queue != store.settings.keys.queue_media
        self.settings = store.settings
        self._deliveries_swept = 0.0  # monotonic time of the last drop_ended_deliveries
        self._attempts_cursor = 0  # HSCAN cursor of the pass over {p}:attempts; 0: between passes
        self._attempts_pass = 0.0  # monotonic time the last pass began

    def sweep(self, mine: Collection[str], others_too: bool) -> list[Requeued]:
        """Requeue what lost its worker; ``mine``: the jobs this process runs now.

        ``others_too`` is False until this worker has been connected to Redis for a whole
        heartbeat TTL: after an outage every worker's heartbeat and leases may have lapsed,
        and the live ones must get the time to beat again before their jobs count as orphans.
        """
        # With the broker apart, what a relay left in the outbox (a broker that was down) goes now.
        self.store.relay()
        now = time.time()
        done: list[Requeued] = []
        # NOTE: a job whose hash is gone has no queue. Any text worker may requeue it, and its
        # claim drops the gone job's entry.
        lapsed = [
            (j, w)
            for j, w, q in self.store.lapsed_leases(now)
            if j not in mine and (q == self.queue or (self.text and not q))
        ]
        alive = self.store.live_workers(w for _, w in lapsed if w != self.name) if others_too else set()
        for job_id, worker in lapsed:
            if worker == self.name or (others_too and worker not in alive):
                done += self._requeue(job_id, now, "lease lapsed", worker)
        if others_too:
            # Text jobs and parts in {p}:queued, image parts in {p}:queued_media (each kind's sweep).
            for job_id in self.store.stale_queued(now - self.settings.lease_s, self.queue):
                done += self._requeue(job_id, now, "message lost", "")
        if others_too and self.text:
            if time.monotonic() - self._deliveries_swept >= self.settings.lease_s:
                self._deliveries_swept = time.monotonic()
                self.drop_ended_deliveries()
        if self.text:
            self.drop_stale_attempts()
        return done

    def drop_stale_attempts(self) -> int:
        """One page of the pass over ``{p}:attempts``: drop the fields of jobs that no longer run.
        A pass starts at most once a lease; returns how many fields this page dropped."""
        if self._attempts_cursor == 0:
            if time.monotonic() - self._attempts_pass < self.settings.lease_s:
                return 0
            self._attempts_pass = time.monotonic()
        self._attempts_cursor, dropped = self.store.drop_stale_attempts(self._attempts_cursor, ATTEMPTS_PAGE)
        if dropped:
            log.info("dropped %d attempts field(s) of jobs that no longer run", dropped)
        return dropped

    def drop_ended_deliveries(self) -> int:
        """Drop kombu's unacknowledged records whose job has ended or expired; returns how many."""
        jobs = {tag: job_of_delivery(record) for tag, record in self.store.unacked_deliveries().items()}
        ended = self.store.ended_or_gone(j for j in jobs.values() if j is not None)
        tags = [tag for tag, job_id in jobs.items() if job_id in ended]
        self.store.drop_deliveries(tags)
        if tags:
            log.info("dropped %d unacknowledged message record(s) of jobs that have ended", len(tags))
        return len(tags)

    def _requeue(self, job_id: str, now: float, reason: str, worker: str) -> list[Requeued]:
        if not self.store.claim_requeue(job_id, now, self.settings.lease_s, self.queue):
            return []
        self.requeue(job_id)
        log.warning("requeued job %s (%s; it was on %r)", job_id, reason, worker)
        return [Requeued(job_id, reason, worker)]


def job_of_delivery(record: str) -> str | None:
    """The job id in one of kombu's unacknowledged records (JSON ``[message, exchange, routing
    key]``; the message's body is Celery's ``[args, kwargs, embed]``, base64); None if none."""
    try:
        message = json.loads(record)[0]
        args = json.loads(base64.b64decode(message["body"]))[0]
        return str(args[0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
