"""The job store: jobs, their event logs and worker heartbeats in Redis.

``SyncJobStore`` (worker threads, ``redis.Redis``) and ``AsyncJobStore`` (API, ``redis.asyncio``)
are thin shells over the same pure parts: the Lua scripts (common/store_lua.py), and the
argument builders and parsers below.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from common.keys import WATCHER_GHOST, Keys
from common.schemas import (
    STORED,
    DoneEvent,
    Job,
    JobError,
    JobRequest,
    JobStatus,
    LogEntry,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
)
from common.settings import Settings
from common.store_lua import APPEND_LUA, CANCEL_LUA, CREATE_LUA, RENEW_LUA, REQUEUE_LUA, TAKE_LUA


class StoreError(RuntimeError):
    """Base of the errors the store raises on purpose."""


class JobNotFound(StoreError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class Conflict(StoreError):
    """The job is in a state that does not allow the operation (e.g. cancelling a finished job)."""


class IdempotencyConflict(Conflict):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"this Idempotency-Key created job {job_id} with a different request")
        self.job_id = job_id


class QueueFull(StoreError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the queue is full ({limit} jobs queued); retry later")
        self.limit = limit


@dataclass(frozen=True)
class JobRecord:
    """Everything stored about a job: the API view plus what only the server needs."""

    job: Job
    request: JobRequest
    owner: str  # API key hash; empty without keys
    attempt: int
    worker: str
    cancel_requested: bool


@dataclass(frozen=True)
class StreamState:
    """What opening a job's event stream needs; read without the log itself."""

    job_id: str
    status: JobStatus
    request: JobRequest
    created_at: float
    model: str | None  # the model of the worker that took it; None while queued
    log_length: int  # the seq of the job's last event (0 before the first)

    @property
    def foreground_and_live(self) -> bool:
        """Whether its streams count as watchers (a job nobody watches is cancelled: detach.py)."""
        return not self.request.background and not self.status.terminal


class TakeStatus(str, enum.Enum):
    TAKEN = "taken"  # this worker now runs the job
    BUSY = "busy"  # another worker runs it and its lease is live
    FINISHED = "finished"  # already terminal (e.g. cancelled while queued)
    MISSING = "missing"  # unknown or expired


@dataclass(frozen=True)
class TakeResult:
    status: TakeStatus
    attempt: int = 0  # the fencing token for every later write (TAKEN)
    record: JobRecord | None = None  # TAKEN
    log: list[LogEntry] = field(default_factory=list)  # TAKEN: events written by earlier attempts
    lease_left_s: float = 0.0  # BUSY


@dataclass(frozen=True)
class Final:
    """How a job ended; rides on its last append."""

    status: JobStatus
    finish_reason: str | None
    error: JobError | None = None


@dataclass(frozen=True)
class Append:
    """One job's writes for one engine step."""

    job_id: str
    attempt: int  # fencing token from take_job
    entries: Sequence[LogEntry]  # consecutive seqs
    prompt_tokens: int
    completion_tokens: int
    final: Final | None = None


class Appended(str, enum.Enum):
    """What became of one Append (APPEND_LUA's reply)."""

    WRITTEN = "written"  # written now, or by an earlier try of the same append
    FENCED = "fenced"  # another worker took the job over (its attempt moved on)
    GAP = "gap"  # still this attempt's, but the log does not end just before the first entry

    @classmethod
    def of(cls, reply: int) -> Appended:
        return {1: cls.WRITTEN, 2: cls.WRITTEN, 0: cls.FENCED}.get(reply, cls.GAP)


# ---- pure parts shared by both stores ------------------------------------------------------

ScriptCall = tuple[list[str], list[Any]]  # (KEYS, ARGV) of one Lua script call


JOB_ID_BYTES = 16  # 128 random bits: a job id is its own capability, so it must not be guessable


def new_job_id() -> str:
    return secrets.token_hex(JOB_ID_BYTES)


def new_job_fields(job_id: str, request: JobRequest, owner: str, now: float) -> dict[str, str]:
    return {
        "id": job_id,
        "status": JobStatus.QUEUED.value,
        "request": request.model_dump_json(),
        "created_at": repr(now),
        "prompt_tokens": "0",
        "completion_tokens": "0",
        "attempt": "0",
        "owner": owner,
    }


@dataclass(frozen=True)
class QueueMessage:
    """A broker message that the script creating a job pushes (LPUSH) onto ``list_key`` with it."""

    list_key: str
    payload: str


MessageFor = Callable[[str], QueueMessage]  # a job id -> the message that hands it to the workers


def create_call(
    keys: Keys,
    settings: Settings,
    request: JobRequest,
    owner: str,
    message_for: MessageFor | None,
    idempotency_key: str | None,
) -> tuple[dict[str, str], ScriptCall]:
    """A new job's fields, and the create script's call that stores them."""
    now, job_id = time.time(), new_job_id()
    fields = new_job_fields(job_id, request, owner, now)
    message = message_for(job_id) if message_for else None
    flat = [x for kv in fields.items() for x in kv]
    script_keys = [keys.queued_jobs(), keys.job(job_id)]
    script_keys += [message.list_key] if message else []
    # An idempotency key is remembered as long as a finished job (its job outlives it).
    idem_ttl: int | str = ""
    if idempotency_key is not None:
        script_keys.append(keys.idempotency(owner, idempotency_key))
        idem_ttl = settings.job_ttl_s
    payload = message.payload if message else ""
    return fields, (script_keys, [settings.max_queued_jobs, job_id, repr(now), payload, idem_ttl, *flat])


def _float_or_none(v: str | None) -> float | None:
    return float(v) if v else None


def job_text(log: Iterable[LogEntry]) -> str:
    return "".join(e.data["text"] for e in log if e.type == "token")


def decode_log(raw: Iterable[str | bytes]) -> list[LogEntry]:
    return [LogEntry.decode(r) for r in raw]


P = TypeVar("P", redis.client.Pipeline, aredis.client.Pipeline)


def record_reads(pipe: P, keys: Keys, job_id: str) -> P:
    """Queue the reads of a job's record: its hash, its text and its log's length.

    In this order, in a pipeline without MULTI: Redis out of memory refuses every command
    queued in a MULTI, reads included, and reads must go on then. The order makes the reads
    consistent enough: the script that ends a job writes its last text and its status at once,
    so a hash read as ended is followed by its whole text (a running job's may be ahead of it).
    """
    pipe.hgetall(keys.job(job_id))
    pipe.get(keys.job_text(job_id))
    pipe.llen(keys.job_log(job_id))
    return pipe


def record_from_hash(h: dict[str, str], text: str) -> JobRecord:
    prompt_tokens, completion_tokens = int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0)
    job = Job(
        id=h["id"],
        status=JobStatus(h["status"]),
        text=text,
        finish_reason=h.get("finish_reason") or None,
        usage=Usage.of(prompt_tokens, completion_tokens),
        error=JobError.model_validate_json(h["error"]) if h.get("error") else None,
        created_at=float(h["created_at"]),
        started_at=_float_or_none(h.get("started_at")),
        finished_at=_float_or_none(h.get("finished_at")),
        model=h.get("model") or None,
    )
    return JobRecord(
        job=job,
        request=JobRequest.model_validate_json(h["request"], context={STORED: True}),
        owner=h.get("owner", ""),
        attempt=int(h.get("attempt") or 0),
        worker=h.get("worker", ""),
        cancel_requested=h.get("cancel_requested") == "1",
    )


def take_args(keys: Keys, job_id: str, worker: str, model: str, now: float, lease_s: float) -> ScriptCall:
    return (
        [keys.job(job_id), keys.job_log(job_id), keys.queued_jobs(), keys.running_jobs(), keys.job_text(job_id)],
        [job_id, worker, model, repr(now), repr(now + lease_s)],
    )


def parse_take(reply: list[Any], now: float) -> TakeResult:
    status = TakeStatus(reply[0])
    if status is TakeStatus.BUSY:
        return TakeResult(status, lease_left_s=max(0.0, float(reply[1]) - now))
    if status is not TakeStatus.TAKEN:
        return TakeResult(status)
    flat = reply[2]
    log = decode_log(reply[3])
    return TakeResult(status, attempt=int(reply[1]), record=record_from_hash(_pairs(flat), job_text(log)), log=log)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def append_args(keys: Keys, a: Append, ttl_s: int, now: float) -> ScriptCall:
    final = a.final
    first_seq = a.entries[0].seq if a.entries else 0
    return (
        [
            keys.job(a.job_id),
            keys.job_log(a.job_id),
            keys.job_events(a.job_id),
            keys.running_jobs(),
            keys.job_text(a.job_id),
        ],
        [
            str(a.attempt),
            first_seq,
            a.prompt_tokens,
            a.completion_tokens,
            final.status.value if final else "",
            (final.finish_reason or "") if final else "",
            repr(now),
            final.error.model_dump_json() if final and final.error else "",
            ttl_s,
            a.job_id,
            job_text(a.entries),
            *(e.encode() for e in a.entries),
        ],
    )


def cancelled_done_entry() -> LogEntry:
    """The terminal event of a job cancelled while queued (its log is empty, so seq 1)."""
    return LogEntry.done(
        1, DoneEvent(status=JobStatus.CANCELLED, finish_reason="cancelled", usage=Usage.of(0, 0))
    )


def cancel_args(keys: Keys, job_id: str, ttl_s: int, now: float) -> ScriptCall:
    return (
        [
            keys.job(job_id),
            keys.job_log(job_id),
            keys.job_events(job_id),
            keys.queued_jobs(),
            keys.cancelled(),
        ],
        [job_id, repr(now), ttl_s, cancelled_done_entry().encode()],
    )


def check_cancel(reply: str, job_id: str) -> None:
    if reply == "missing":
        raise JobNotFound(job_id)
    if reply not in ("cancelled", "requested"):
        raise Conflict(f"job {job_id!r} already finished with status {reply!r}")


def check_created(reply: int | str, max_queued: int) -> str | None:
    """None when the job was created; the id of the earlier job its idempotency key names."""
    if isinstance(reply, str):
        return reply
    if not reply:
        raise QueueFull(max_queued)
    return None


def check_replay(earlier: JobRecord, request: JobRequest) -> Job:
    """The earlier job of an idempotency key, if it was created for the same request."""
    if earlier.request.model_dump_json() != request.model_dump_json():
        raise IdempotencyConflict(earlier.job.id)
    return earlier.job


# NOTE: liveness is the heartbeat key's TTL (a lapsed worker's key reads as None below); the
# registry only lists names to look at, and forgets a worker after an hour without a beat.
WORKER_FORGET_S = 3600.0


def watching(members: Iterable[tuple[str, float]], now: float, grace_s: float) -> bool:
    """Whether a job's watcher set (Keys.job_watchers: member, score) still watches it at ``now``.

    A watcher counts while its lease runs, and for ``grace_s`` after it lapsed (its API process
    died: its clients get the grace from then to resume elsewhere); a ghost, while its grace runs.
    """
    return any(score >= (now if m.startswith(WATCHER_GHOST) else now - grace_s) for m, score in members)


def worker_keys(keys: Keys, names: Iterable[str]) -> list[str]:
    return [keys.worker(n) for n in names]


def heartbeats_from(values: Iterable[str | bytes | None]) -> list[WorkerHeartbeat]:
    # NOTE: a key can expire between SCAN and MGET; it then reads as None.
    return [WorkerHeartbeat.model_validate_json(v) for v in values if v]


def token_entry(seq: int, index: int, text: str, token_ids: Sequence[int]) -> LogEntry:
    return LogEntry.token(seq, TokenEvent(index=index, text=text, token_ids=list(token_ids)))


# ---- the stores ----------------------------------------------------------------------------

# NOTE: clients made with from_url retry nothing unless told to. After a Redis restart every
# pooled connection is dead; without retries each one fails its next command (pipelines too)
# once, so the API would answer 503s for a while after Redis is back. A retry reconnects at once.
# Every script is safe to run twice (appends check the seq, takes return the attempt they set).
REDIS_RETRIES = 3
REDIS_BACKOFF = {"base": 0.05, "cap": 0.5}  # seconds
# No command of the store blocks in Redis, so an answer slower than this means a dead or
# half-open connection: fail (and retry on a new one) rather than hang a worker or a request.
REDIS_TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}


ASYNC_POOL_SIZE = 128  # Redis connections per API process
WRITE_PROBE_TTL_MS = 10_000
ASYNC_POOL_WAIT_S = 10.0  # how long a command waits for one before it fails


def _sync_client(url: str) -> redis.Redis:
    retry = Retry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    return redis.Redis.from_url(url, decode_responses=True, retry=retry, **REDIS_TIMEOUTS)


def _async_client(url: str) -> aredis.Redis:
    retry = AsyncRetry(ExponentialBackoff(**REDIS_BACKOFF), REDIS_RETRIES)
    # NOTE: the default async pool fails the 101st concurrent command with "Too many
    # connections", which the API would report as Redis being down (seen with 1,000 open
    # streams). A blocking pool makes a burst wait for a free connection instead.
    pool = aredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        retry=retry,
        max_connections=ASYNC_POOL_SIZE,
        timeout=ASYNC_POOL_WAIT_S,
        **REDIS_TIMEOUTS,
    )
    return aredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


class _Base:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = settings.keys


class SyncJobStore(_Base):
    """The worker's store. Thread-safe: redis.Redis draws a connection from its pool per call."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        super().__init__(settings)
        self.redis = client
        self._create = client.register_script(CREATE_LUA)
        self._take = client.register_script(TAKE_LUA)
        self._cancel = client.register_script(CANCEL_LUA)
        self._append = client.register_script(APPEND_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._requeue = client.register_script(REQUEUE_LUA)

    @classmethod
    def from_settings(cls, settings: Settings) -> SyncJobStore:
        return cls(_sync_client(settings.redis_url), settings)

    def close(self) -> None:
        self.redis.close()

    def create_job(
        self,
        request: JobRequest,
        owner: str = "",
        message_for: MessageFor | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        fields, (keys, args) = create_call(
            self.keys, self.settings, request, owner, message_for, idempotency_key
        )
        earlier = check_created(self._create(keys, args), self.settings.max_queued_jobs)
        if earlier is not None:
            return check_replay(self.get_record(earlier), request)
        return record_from_hash(fields, "").job

    def get_record(self, job_id: str) -> JobRecord:
        pipe = self.redis.pipeline(transaction=False)  # see record_reads
        h, text, logged = record_reads(pipe, self.keys, job_id).execute()
        if not h:
            raise JobNotFound(job_id)
        if text is None and logged:  # cancelled while queued, or written by a worker of an older version
            text = job_text(self.read_log(job_id))
        return record_from_hash(h, text or "")

    def get_job(self, job_id: str) -> Job:
        return self.get_record(job_id).job

    def read_log(self, job_id: str, after: int = 0) -> list[LogEntry]:
        return decode_log(self.redis.lrange(self.keys.job_log(job_id), after, -1))

    def take_job(self, job_id: str, worker: str, model: str) -> TakeResult:
        now = time.time()
        keys, args = take_args(self.keys, job_id, worker, model, now, self.settings.lease_s)
        return parse_take(self._take(keys, args), now)

    def request_cancel(self, job_id: str) -> Job:
        keys, args = cancel_args(self.keys, job_id, self.settings.job_ttl_s, time.time())
        check_cancel(self._cancel(keys, args), job_id)
        return self.get_job(job_id)

    def append_batch(self, appends: Sequence[Append]) -> list[Appended]:
        """Write one engine step for many jobs in one round trip; what became of each append."""
        now = time.time()
        calls = [append_args(self.keys, a, self.settings.job_ttl_s, now) for a in appends]
        return [Appended.of(r) for r in self._evalsha_all(calls)]

    def _evalsha_all(self, calls: list[ScriptCall]) -> list[Any]:
        # NOTE: Script objects in a pipeline cost an extra SCRIPT EXISTS round trip per execute;
        # EVALSHA directly, and load the script only when Redis answers NOSCRIPT (after a restart).
        script = self._append
        pipe = self.redis.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in replies):
            script.sha = self.redis.script_load(script.script)
            replies = [
                script(keys, args) if isinstance(r, NoScriptError) else r
                for r, (keys, args) in zip(replies, calls, strict=True)
            ]
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return replies

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
        ids = [str(j) for j in self.redis.zrange(self.keys.running_jobs(), 0, -1)]
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
        if not held:
            return []
        keys = [self.keys.running_jobs(), *(self.keys.job(j) for j in held)]
        args: list[Any] = [repr(deadline)]
        for job_id, attempt in held.items():
            args += [job_id, str(attempt)]
        return list(self._renew(keys, args))

    def lapsed_leases(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        """(job id, worker) of running jobs whose lease lapsed: their worker stopped renewing it."""
        ids = [
            str(j)
            for j in self.redis.zrangebyscore(self.keys.running_jobs(), "-inf", now, start=0, num=limit)
        ]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.keys.job(job_id), "worker")
        return [(j, w or "") for j, w in zip(ids, pipe.execute(), strict=True)]

    def stale_queued(self, queued_before: float, limit: int = 100) -> list[str]:
        """Jobs queued since before ``queued_before`` although the Celery queue is empty.

        With messages in the queue, old queued jobs are just waiting their turn; with none, a job
        still queued long after it was sent lost its message (e.g. Redis went down as a worker
        received it), and only sending it again runs it.
        """
        pipe = self.redis.pipeline(transaction=False)
        for name in self.keys.queue_lists(self.keys.queue_llm):
            pipe.llen(name)
        if any(pipe.execute()):
            return []
        ids = self.redis.zrangebyscore(self.keys.queued_jobs(), "-inf", queued_before, start=0, num=limit)
        return [str(j) for j in ids]

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
        return dict(self.redis.hscan_iter(self.keys.broker_unacked["unacked_key"], count=500))

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
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(names["unacked_index_key"], *tags)
        pipe.hdel(names["unacked_key"], *tags)
        pipe.execute()

    def claim_requeue(self, job_id: str, now: float, min_gap_s: float) -> bool:
        """Atomically claim sending this job's message again; True for exactly one claimer per gap."""
        keys = [self.keys.job(job_id), self.keys.running_jobs(), self.keys.queued_jobs()]
        return bool(self._requeue(keys, [job_id, repr(now), repr(min_gap_s)]))

    def cancel_requested(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these jobs a client asked to cancel (covers cancel messages missed on pub/sub)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel_requested")
        return [j for j, flag in zip(job_ids, pipe.execute(), strict=True) if flag == "1"]

    def unwatched(self, job_ids: Sequence[str], now: float, grace_s: float) -> list[str]:
        """Which of these jobs nobody watches (see ``watching``; api/openai_compat/detach.py)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.zrangebyscore(self.keys.job_watchers(job_id), now - grace_s, "+inf", withscores=True)
        return [
            job_id
            for job_id, members in zip(job_ids, pipe.execute(), strict=True)
            if not watching(members, now, grace_s)
        ]

    def beat(self, heartbeat: WorkerHeartbeat) -> None:
        now, ttl_ms = time.time(), int(self.settings.heartbeat_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(heartbeat.name), heartbeat.model_dump_json(), px=ttl_ms)
        pipe.zadd(self.keys.workers(), {heartbeat.name: now})
        pipe.zremrangebyscore(self.keys.workers(), "-inf", now - WORKER_FORGET_S)
        pipe.execute()

    def remove_heartbeat(self, name: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(name))
        pipe.zrem(self.keys.workers(), name)
        pipe.execute()

    def list_workers(self) -> list[WorkerHeartbeat]:
        names = [str(n) for n in self.redis.zrange(self.keys.workers(), 0, -1)]
        return heartbeats_from(self.redis.mget(worker_keys(self.keys, names))) if names else []


class AsyncJobStore(_Base):
    """The API's store, over redis.asyncio."""

    def __init__(self, client: aredis.Redis, settings: Settings) -> None:
        super().__init__(settings)
        self.redis = client
        self._create = client.register_script(CREATE_LUA)
        self._cancel = client.register_script(CANCEL_LUA)

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncJobStore:
        return cls(_async_client(settings.redis_url), settings)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def probe_write(self) -> None:
        """One small write, which raises while Redis refuses writes (common/redis_errors.py)."""
        await self.redis.set(self.keys.write_probe(), "1", px=WRITE_PROBE_TTL_MS)

    async def create_job(
        self,
        request: JobRequest,
        owner: str = "",
        message_for: MessageFor | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Store a queued job, and with ``message_for`` its broker message in the same script.

        With an ``idempotency_key`` that this owner used before (within SPOOL_JOB_TTL_S), no job
        is created: the earlier one is returned, or IdempotencyConflict raised when it was made
        for another request. Raises QueueFull when SPOOL_MAX_QUEUED_JOBS jobs are queued.
        """
        fields, (keys, args) = create_call(
            self.keys, self.settings, request, owner, message_for, idempotency_key
        )
        earlier = check_created(await self._create(keys, args), self.settings.max_queued_jobs)
        if earlier is not None:
            return check_replay(await self.get_record(earlier), request)
        return record_from_hash(fields, "").job

    async def get_record(self, job_id: str) -> JobRecord:
        async with self.redis.pipeline(transaction=False) as pipe:  # see record_reads
            h, text, logged = await record_reads(pipe, self.keys, job_id).execute()
        if not h:
            raise JobNotFound(job_id)
        if text is None and logged:  # cancelled while queued, or written by a worker of an older version
            text = job_text(await self.read_log(job_id))
        return record_from_hash(h, text or "")

    async def get_job(self, job_id: str) -> Job:
        return (await self.get_record(job_id)).job

    async def stream_state(self, job_id: str) -> StreamState:
        # No MULTI (see record_reads): a log read after the hash is at least as long as it says.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.job(job_id), ["status", "request", "created_at", "model"])
            pipe.llen(self.keys.job_log(job_id))
            (status, request, created_at, model), length = await pipe.execute()
        if status is None:
            raise JobNotFound(job_id)
        return StreamState(
            job_id,
            JobStatus(status),
            JobRequest.model_validate_json(request, context={STORED: True}),
            float(created_at),
            model or None,
            int(length),
        )

    async def read_log(self, job_id: str, after: int = 0) -> list[LogEntry]:
        """The events with seq > after (entry i holds seq i + 1)."""
        return decode_log(await self.redis.lrange(self.keys.job_log(job_id), after, -1))

    async def request_cancel(self, job_id: str) -> Job:
        """Cancel a job: at once if queued, at the worker's next step if running.

        Raises JobNotFound, or Conflict if the job already finished otherwise than cancelled.
        """
        keys, args = cancel_args(self.keys, job_id, self.settings.job_ttl_s, time.time())
        check_cancel(await self._cancel(keys, args), job_id)
        return await self.get_job(job_id)

    async def queued_count(self) -> int:
        return int(await self.redis.zcard(self.keys.queued_jobs()))

    async def watched(self, job_id: str, now: float, grace_s: float) -> bool:
        """Whether anybody watches the job (see ``watching``); drops the members past counting."""
        key = self.keys.job_watchers(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:  # in order on one connection
            pipe.zremrangebyscore(key, "-inf", f"({now - grace_s!r}")
            pipe.zrange(key, 0, -1, withscores=True)
            _, members = await pipe.execute()
        return watching(members, now, grace_s)

    async def list_workers(self) -> list[WorkerHeartbeat]:
        names = [str(n) for n in await self.redis.zrange(self.keys.workers(), 0, -1)]
        return heartbeats_from(await self.redis.mget(worker_keys(self.keys, names))) if names else []
