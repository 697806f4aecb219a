"""The worker's store, over ``redis.Redis``: take jobs, append their events, heartbeats and leases.

Every key it writes: docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import redis

from common.artifacts import Artifacts, part_name
from common.keys import part_id, split_part_id
from common.schemas.views import WorkerHeartbeat
from common.settings import Settings
from common.store.calls import (
    cancel_args,
    parse_take,
    part_append_args,
    part_take_args,
    take_args,
    unserved_args,
)
from common.store.clients import data_client, sync_client
from common.store.files import UPLOAD_TTL_S
from common.store.outbox import SyncOutbox
from common.store.records import (
    WORKER_FORGET_S,
    Append,
    Appended,
    TakeResult,
    heartbeats_from,
    oldest_of,
    oldest_page,
    worker_keys,
)
from common.store.scripts import source
from common.store.service_times import record_service_times
from common.store.steps import StepWriter
from common.store.watchers import watching

if TYPE_CHECKING:
    from common.prompt_tokens import TokenizerSpec

log = logging.getLogger(__name__)

# Oldest queued jobs read to find one model's (the queued set holds every model's); a worker's
# intake reads this many each poll while it holds batch lines (workers/runtime.py).
QUEUED_PAGE = 64


class SyncJobStore:
    """The worker's store. Thread-safe: redis.Redis draws a connection from its pool per call.

    The API's operations (create, read, cancel) are the API's store's (common/store/aio.py), but
    for ``cancel_job``: a worker cancels an abandoned foreground job with parts; tests
    that play the API synchronously have their twins (tests/store_helpers.py).
    """

    def __init__(self, client: redis.Redis, settings: Settings, broker: redis.Redis | None = None) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = client
        # The broker's Redis (its queue lists and kombu's records), when another than the job
        # data's (SPOOL_BROKER_URL): the scripts' messages wait in the outbox for a relay.
        self.broker = broker or client
        self.outbox = SyncOutbox(client, broker, self.keys) if broker is not None else None
        self._take = client.register_script(source("take"))
        self._steps = StepWriter(client, self.keys)
        self._part_take = client.register_script(source("part_take"))
        self._part_append = client.register_script(source("part_append"))
        self._renew = client.register_script(source("renew"))
        self._requeue = client.register_script(source("requeue"))
        self._unserved = client.register_script(source("unserved"))
        self._cancel = client.register_script(source("cancel"))
        self._drop_attempts = client.register_script(source("drop_attempts"))
        self._release_held = client.register_script(source("release_held"))
        self.artifacts = Artifacts.at(settings.artifact_url)

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        broker = sync_client(settings.broker_redis_url) if settings.broker_apart else None
        return cls(data_client(settings.redis_url), settings, broker)

    def close(self) -> None:
        self.redis.close()
        if self.broker is not self.redis:
            self.broker.close()

    def relay(self, buckets: Iterable[int] | None = None) -> int:
        """Send the broker messages the scripts left in the outboxes (those of ``buckets``, or
        all: common/store/outbox.py); returns how many (0 with one Redis, where the scripts send
        them). A Redis error is logged: what is left waits for the next relay."""
        return self.outbox.relay_or_log(buckets) if self.outbox is not None else 0

    def take_job(self, job_id: str, worker: str, model: str) -> TakeResult:
        """Take a job, or a part of one (its id from ``common.keys.part_id``), to run it."""
        now, lease_s = time.time(), self.settings.lease_s
        if (split := split_part_id(job_id)) is not None:
            keys, args = part_take_args(self.keys, job_id, worker, model, now, lease_s)
            return parse_take(self._part_take(keys, args), split[1])
        keys, args = take_args(self.keys, job_id, worker, model, now, lease_s)
        return parse_take(self._take(keys, args))

    def append_batch(self, appends: Sequence[Append]) -> list[Appended]:
        """Write one engine step for many jobs in one script call (one per master on a Redis
        Cluster: common/store/steps.py), fenced per job inside it, and each part's append in a call
        of its own (parts are few); what became of each append."""
        now, ttl = time.time(), self.settings.job_ttl_s
        results: list[Appended | None] = [None] * len(appends)
        jobs = [i for i, a in enumerate(appends) if not split_part_id(a.job_id)]
        for i, reply in zip(jobs, self._steps.write([appends[i] for i in jobs], ttl), strict=True):
            results[i] = Appended.of(reply)
        for i, a in enumerate(appends):
            if results[i] is None:  # a part's, in order (several steps of one part stay in order)
                keys, args = part_append_args(self.keys, self._stored_content(a, now), ttl)
                results[i] = Appended.of(self._part_append(keys, args))
        ended = [appends[i].job_id for i in jobs if appends[i].final and results[i] is Appended.WRITTEN]
        record_service_times(self.redis, self.keys, ended)
        if len(jobs) < len(appends):  # a part's append may have sent its held or dependent parts
            self.relay({self.keys.bucket_of(a.job_id) for a in appends})
        return [r for r in results if r is not None]

    def _stored_content(self, a: Append, now: float) -> Append:
        """With SPOOL_ARTIFACT_URL set, a part's content (an image) goes to its artifact, and the
        append carries the artifact's name. Indexed before it is written to be deleted an hour
        after its reference (the content key, Keys.part_content) expires; one this attempt never
        appends (fenced) is deleted with it."""
        if not a.content or self.artifacts is None:
            return a
        name = part_name(a.job_id, a.attempt)
        deadline = now + self.settings.job_ttl_s + UPLOAD_TTL_S
        self.redis.zadd(self.keys.artifacts(self.keys.bucket_of(a.job_id)), {name: deadline}, gt=True)
        self.artifacts.write(name, a.content)
        return dataclasses.replace(a, content=name.encode())

    def part_text(self, job_id: str, index: int) -> str:
        """The text of a job's text part so far (its final text once it succeeded)."""
        return str(self.redis.get(self.keys.job_text(part_id(job_id, index))) or "")

    def release_held(self, now: float, limit: int = 100) -> float | None:
        """Send the messages of the held image parts whose bound (SPOOL_IMAGE_HOLD_S after their
        job's creation) passed by ``now``, as their text parts' first tokens would (release_held.lua);
        returns the next held part's bound, or None when no part is held."""
        bounds = [self._release_held_in(b, now, limit) for b in self.keys.bucket_range()]
        return min((b for b in bounds if b is not None), default=None)

    def _release_held_in(self, bucket: int, now: float, limit: int) -> float | None:
        held = self.keys.held_media(bucket)
        earliest: list[Any] = self.redis.zrange(held, 0, limit - 1, withscores=True)
        due = [(str(m), float(s)) for m, s in earliest]
        ids = [m for m, score in due if score <= now]
        if not ids:
            return due[0][1] if due else None
        jobs = sorted({split[0] for split in map(split_part_id, ids) if split is not None})
        keys = [held, self.keys.queued_media(bucket), *(self.keys.job(j) for j in jobs)]
        nxt = self._release_held(keys, [repr(now), *ids])
        self.relay([bucket])
        return None if nxt is None else float(nxt)

    def renew_leases(self, held: Mapping[str, int]) -> list[str]:
        """Extend the leases of the jobs this worker holds (job id -> attempt); returns those it lost.

        A job is lost when another worker took it over (its attempt moved on) or it expired; one
        that ended at its attempt is not (this worker wrote its end, maybe just now).
        """
        return self._set_leases(held, time.time() + self.settings.lease_s)

    def release_leases(self, worker: str) -> list[str]:
        """Lapse the leases of the running jobs recorded as ``worker``'s; returns their ids.

        For a worker process that starts: it holds no job yet, so any job under its name is an
        orphan of its previous life, and the next sweep requeues it at once instead of a lease
        later. Fenced by attempt, so a job another worker took over meanwhile keeps its lease.
        """
        ids = [
            str(j)
            for b in self.keys.bucket_range()
            for j in self.redis.zrange(self.keys.running_jobs(b), 0, -1)
        ]
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys.job(job_id), ["worker", "attempt"])
        held = {j: int(a) for j, (w, a) in zip(ids, pipe.execute(), strict=True) if w == worker and a}
        self.lapse_leases(held)
        return list(held)

    def lapse_leases(self, held: Mapping[str, int]) -> None:
        """Lapse the leases of these jobs (job id -> attempt) where the attempt is still theirs,
        so that the next sweep requeues them and a take-over resumes them from the log."""
        self._set_leases(held, 0.0)

    def _set_leases(self, held: Mapping[str, int], deadline: float) -> list[str]:
        """Set the lease deadline of jobs still at these attempts and running; returns the others."""
        lost = []
        for bucket, ids in self.keys.by_bucket(held).items():
            keys = [self.keys.running_jobs(bucket), *(self.keys.job(j) for j in ids)]
            args: list[Any] = [repr(deadline)]
            for job_id in ids:
                args += [job_id, str(held[job_id])]
            lost += self._renew(keys, args)
        return lost

    def lapsed_leases(self, now: float, limit: int = 100) -> list[tuple[str, str, str]]:
        """(job id, worker, queue) of running jobs whose lease lapsed: their worker stopped renewing
        it. The queue is the Celery queue the job's messages go to (its model's, for text)."""
        ids = [
            str(j)
            for b in self.keys.bucket_range()
            for j in self.redis.zrangebyscore(self.keys.running_jobs(b), "-inf", now, start=0, num=limit)
        ][:limit]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys.job(job_id), ["worker", "type", "queue"])
        kinds = {"image": self.keys.queue_media}
        replies = zip(ids, pipe.execute(), strict=True)
        return [(j, w or "", kinds.get(t or "", q or "")) for j, (w, t, q) in replies]

    def stale_queued(self, queued_before: float, queue: str, limit: int = 100) -> list[str]:
        """Jobs of ``queue`` queued since before ``queued_before`` although that Celery queue is empty.

        With messages in the queue, old queued jobs are just waiting their turn; with none, a job
        still queued long after it was sent lost its message (e.g. Redis went down as a worker
        received it), and only sending it again runs it. ``queue``: a model's (text jobs and text
        parts of that model), or ``keys.queue_media`` (image parts).
        """
        pipe = self.broker.pipeline(transaction=False)
        for name in self.keys.queue_lists(queue):
            pipe.llen(name)
        if any(pipe.execute()):
            return []
        media = queue == self.keys.queue_media
        found: list[str] = []
        for b in self.keys.bucket_range():
            name = self.keys.queued_media(b) if media else self.keys.queued_jobs(b)
            ids = self.redis.zrangebyscore(
                name, "-inf", queued_before, start=0, num=limit if media else QUEUED_PAGE
            )
            found += [str(j) for j in ids] if media else self._of_queue(ids, queue)
            if len(found) >= limit:
                break
        return found[:limit]

    def oldest_queued(self, limit: int, queue: str) -> list[str]:
        """The jobs (and text parts) of ``queue`` (a model's) queued longest, oldest first:
        interactive work only (a batch's lines are never in the queued set, flex jobs are left out).

        NOTE: the queued set holds every model's jobs; those of ``queue`` are looked for among the
        oldest ``QUEUED_PAGE`` only, so a model whose jobs wait behind that many of other models'
        is left to its messages (which its workers take all the same)."""
        per = oldest_page(self.keys, QUEUED_PAGE)
        pipe = self.redis.pipeline(transaction=False)
        for b in self.keys.bucket_range():
            pipe.zrange(self.keys.queued_jobs(b), 0, per - 1, withscores=True)
        oldest = oldest_of(pipe.execute(), per, QUEUED_PAGE)
        return self._of_queue(oldest, queue, interactive=True)[:limit]

    def _of_queue(self, ids: Sequence[Any], queue: str, interactive: bool = False) -> list[str]:
        """Those of these jobs whose messages go to ``queue`` (``interactive``: and not of the
        batch tier), in order."""
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys.job(str(job_id)), ["queue", "tier"])
        replies = zip(ids, pipe.execute(), strict=True)
        return [str(j) for j, (q, tier) in replies if q == queue and not (interactive and tier)]

    def unserved_queued(
        self, live_queues: Collection[str], queued_before: float
    ) -> list[tuple[str, str, str | None, bool]]:
        """The jobs queued since before ``queued_before`` (among the oldest ``QUEUED_PAGE`` of each
        bucket) whose queue is a text queue none of ``live_queues``: (id, queue, the model their
        request named, None for none, whether it is an embedding job). Parts are left out (their
        job's parts run together)."""
        pipe = self.redis.pipeline(transaction=False)
        for b in self.keys.bucket_range():
            pipe.zrangebyscore(self.keys.queued_jobs(b), "-inf", queued_before, start=0, num=QUEUED_PAGE)
        ids = [str(j) for page in pipe.execute() for j in page if not split_part_id(str(j))]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.keys.job(job_id), "queue")
        found = [(j, str(q)) for j, q in zip(ids, pipe.execute(), strict=True) if q and q not in live_queues]
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _ in found:
            pipe.hget(self.keys.job(job_id), "request")
        requests = pipe.execute() if found else []
        loaded = [json.loads(r) if r else {} for r in requests]
        return [
            (j, q, request.get("model"), request.get("embed") is not None)
            for (j, q), request in zip(found, loaded, strict=True)
        ]

    def unserved(self, job_id: str, queue: str, to: str, message: str) -> str:
        """Move a job still queued for ``queue`` to the live queue ``to`` (the caller sends its
        message there), or, with ``to`` empty, fail it with ``model_not_served`` and ``message``
        (unserved.lua); returns 'moved', 'failed' or 'left' (no longer queued there)."""
        keys, args = unserved_args(self.keys, job_id, queue, to, self.settings.job_ttl_s, message)
        return str(self._unserved(keys, args))

    def live_text_models(self) -> set[str]:
        """The models of the text workers with a live heartbeat."""
        names = [str(n) for n in self.redis.zrange(self.keys.workers(), 0, -1)]
        pipe = self.redis.pipeline(transaction=False)
        for key in worker_keys(self.keys, names):
            pipe.get(key)
        return {w.model for w in heartbeats_from(pipe.execute() if names else []) if w.kind == "text"}

    def served_stamps(self) -> dict[str, float]:
        """Each text model served within ``WORKER_FORGET_S`` -> its last heartbeat's time."""
        stamps: list[Any] = self.redis.zrange(self.keys.served_models(), 0, -1, withscores=True)
        return {str(m): float(t) for m, t in stamps}

    def live_workers(self, names: Iterable[str]) -> set[str]:
        """Which of these workers have a live heartbeat."""
        names = sorted(set(names))
        if not names:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(self.keys.worker(name))
        return {n for n, alive in zip(names, pipe.execute(), strict=True) if alive}

    def unacked_deliveries(self) -> dict[str, str]:
        """kombu's records of the messages delivered and not acknowledged: delivery tag -> record."""
        return dict(self.broker.hscan_iter(self.keys.broker_unacked["unacked_key"], count=500))

    def ended_or_gone(self, job_ids: Iterable[str]) -> set[str]:
        """Which of these jobs have ended (succeeded, failed, cancelled) or expired."""
        ids = sorted(set(job_ids))
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.keys.job(job_id), "status")
        statuses = pipe.execute()
        return {j for j, status in zip(ids, statuses, strict=True) if status not in ("queued", "running")}

    def drop_deliveries(self, tags: Sequence[str]) -> None:
        """Remove kombu's records of these deliveries, as its acknowledgement would."""
        if not tags:
            return
        names = self.keys.broker_unacked
        pipe = self.broker.pipeline(transaction=False)
        pipe.zrem(names["unacked_index_key"], *tags)
        pipe.hdel(names["unacked_key"], *tags)
        pipe.execute()

    def drop_stale_attempts(self, cursor: int, count: int) -> tuple[int, int]:
        """One page of a pass over the buckets' ``{p}:attempts`` (HSCAN from ``cursor``, about
        ``count`` fields): drop the fields of jobs that no longer run (their hash is gone, or they
        ended). Returns (the next cursor, 0 once the pass is over; how many fields it dropped).
        The cursor is HSCAN's times the number of buckets, plus the bucket it scans."""
        buckets = self.keys.buckets
        bucket, scan = cursor % buckets, cursor // buckets
        name = self.keys.attempts(bucket)
        scan, fields = self.redis.hscan(name, scan, count=count)
        nxt = int(scan) * buckets + bucket if int(scan) else (bucket + 1) % buckets
        ids = [str(j) for j in fields]
        if not ids:
            return nxt, 0
        return nxt, int(self._drop_attempts([name, *(self.keys.job(j) for j in ids)], ids))

    def _queued_set(self, queue: str, job_id: str) -> str:
        bucket = self.keys.bucket_of(job_id)
        return (
            self.keys.queued_media(bucket)
            if queue == self.keys.queue_media
            else self.keys.queued_jobs(bucket)
        )

    def claim_requeue(self, job_id: str, now: float, min_gap_s: float, queue: str = "") -> bool:
        """Atomically claim sending this job's message again; True for exactly one claimer per gap.
        ``queue``: as ``stale_queued``'s (where a queued job's entry is)."""
        bucket = self.keys.bucket_of(job_id)
        keys = [self.keys.job(job_id), self.keys.running_jobs(bucket), self._queued_set(queue, job_id)]
        return bool(self._requeue(keys, [job_id, repr(now), repr(min_gap_s)]))

    def cancel_requested(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these jobs a client asked to cancel (covers cancel messages missed on pub/sub)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel_requested")
        return [j for j, flag in zip(job_ids, pipe.execute(), strict=True) if flag == "1"]

    def unwatched(self, job_ids: Sequence[str], grace_s: float) -> list[str]:
        """Which of these jobs nobody watches now, on Redis's clock (see ``watching``;
        api/watchers.py). A part counts its job's watchers."""
        seconds, micros = self.redis.time()  # before the sets are read (a cluster pipes no TIME)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            split = split_part_id(job_id)
            pipe.zrange(self.keys.job_watchers(split[0] if split else job_id), 0, -1, withscores=True)
        sets = pipe.execute()
        now = seconds + micros / 1e6
        return [
            job_id
            for job_id, members in zip(job_ids, sets, strict=True)
            if not watching(members, now, grace_s)
        ]

    def cancel_job(self, job_id: str) -> None:
        """Cancel a job as the API's cancel does (cancel.lua): a job with parts cancels its queued
        parts at once and asks their workers to end the running ones. A job already ended stays so."""
        keys, args = cancel_args(self.keys, job_id, self.settings.job_ttl_s)
        self._cancel(keys, args)

    def beat(self, heartbeat: WorkerHeartbeat, tokenizer: TokenizerSpec | None = None) -> None:
        """Write the heartbeat, and keep the tokenizer spec it names alive as long as it (stored
        again if it lapsed meanwhile: Redis away for longer, or restarted empty)."""
        now, ttl_ms = time.time(), int(self.settings.heartbeat_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(heartbeat.name), heartbeat.model_dump_json(), px=ttl_ms)
        pipe.zadd(self.keys.workers(), {heartbeat.name: now})
        pipe.zremrangebyscore(self.keys.workers(), "-inf", now - WORKER_FORGET_S)
        if heartbeat.kind == "text":
            pipe.zadd(self.keys.served_models(), {heartbeat.model: now})
            pipe.zremrangebyscore(self.keys.served_models(), "-inf", now - WORKER_FORGET_S)
        if tokenizer is not None:
            pipe.pexpire(self.keys.tokenizer(tokenizer.digest), ttl_ms)  # after the heartbeat's: never sooner
        kept = pipe.execute()[-1]
        if tokenizer is not None and not kept:
            self.put_tokenizer(tokenizer)

    def heartbeat(self, name: str) -> WorkerHeartbeat | None:
        """The live heartbeat of the worker ``name``, if it has one."""
        return next(iter(heartbeats_from([self.redis.get(self.keys.worker(name))])), None)

    def put_tokenizer(self, tokenizer: TokenizerSpec) -> None:
        """Store a served model's tokenizer spec for a heartbeat's time; ``beat`` keeps it."""
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        self.redis.set(self.keys.tokenizer(tokenizer.digest), tokenizer.to_json(), px=ttl_ms, nx=True)

    def remove_heartbeat(self, name: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(name))
        pipe.zrem(self.keys.workers(), name)
        pipe.execute()
