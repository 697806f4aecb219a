"""Finds the jobs nobody runs any more and sends their messages again, so another worker takes them.

Every live worker runs this sweep from its heartbeat thread, so recovery needs no extra process.
It requeues a running job whose lease lapsed and whose worker has no live heartbeat, and a
queued job whose message was lost, within its own Celery queue only. It also drops kombu's
records of ended deliveries and the ``{p}:attempts`` fields of jobs that no longer run. The
rules are in docs/internals.md#job-lifecycle and, for the keys,
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.

Celery's visibility timeout would also redeliver a dead worker's message, but only after an hour.
The sweep acts within a lease. ``claim_requeue`` makes exactly one worker send each requeue, and
a duplicate message finds its job running or finished and is dropped.
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
    reason: str  # "lease lapsed" | "message lost" | "model not served"
    previous_worker: str  # the worker whose lease lapsed; empty for a queued job


class Reaper:
    def __init__(
        self, store: SyncJobStore, name: str, requeue: Requeue, queue: str, embeds: bool = False
    ) -> None:
        self.store = store
        self.name = name  # this worker's name, as in the job hashes' `worker`
        self.requeue = requeue
        # The jobs it requeues: those of its own Celery queue (its model's, or {p}.media); a media
        # worker's sweep leaves text jobs to text workers, and a text worker's other models' jobs.
        self.queue = queue
        self.text = queue != store.settings.keys.queue_media
        self.embeds = embeds  # its model embeds: it takes in only the embedding jobs of unserved models
        self.settings = store.settings
        self._deliveries_swept = 0.0  # monotonic time of the last drop_ended_deliveries
        self._unserved_swept = 0.0  # monotonic time of the last look for jobs of unserved models
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
            if time.monotonic() - self._unserved_swept >= min(
                self.settings.lease_s, self.settings.unserved_grace_s
            ):
                self._unserved_swept = time.monotonic()
                done += self.unserved(now)
            if time.monotonic() - self._deliveries_swept >= self.settings.lease_s:
                self._deliveries_swept = time.monotonic()
                self.drop_ended_deliveries()
        if self.text:
            self.drop_stale_attempts()
        return done

    def unserved(self, now: float) -> list[Requeued]:
        """The queued jobs of models no live worker has served for ``SPOOL_UNSERVED_GRACE_S`` (from
        their model's last heartbeat, or their creation, whichever is later): one whose request
        named no model moves to this worker's queue and is sent there, if it is of the worker's kind
        (an embedding job to a worker whose model embeds, else one that generates); one that named its model
        fails with ``model_not_served``. Only a live text worker looks, so while no worker at all
        is live (they restart) every job waits."""
        grace, keys = self.settings.unserved_grace_s, self.settings.keys
        live = {keys.model_queue(m) for m in self.store.live_text_models()} | {self.queue}
        stamps = self.store.served_stamps()
        model_of = {keys.model_queue(m): m for m in stamps}
        done: list[Requeued] = []
        for job_id, queue, named, embeds in self.store.unserved_queued(live, now - grace):
            model = model_of.get(queue)
            if model is not None and stamps[model] > now - grace:
                continue  # its workers beat within the grace: they restart
            if named is None:
                if embeds != self.embeds:
                    continue  # NOTE: a worker of the other kind (generate, embed) moves it
                if self.store.unserved(job_id, queue, self.queue, "") == "moved":
                    self.requeue(job_id)
                    log.warning(
                        "moved job %s from %s, which no live worker serves, to %s", job_id, queue, self.queue
                    )
                    done.append(Requeued(job_id, "model not served", ""))
                continue
            message = (
                f"No live worker has served the model {named!r} for {grace:g} s (SPOOL_UNSERVED_GRACE_S); "
                "the job was not run"
            )
            if self.store.unserved(job_id, queue, "", message) == "failed":
                log.warning("failed job %s: no live worker serves its model %r", job_id, named)
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
