"""What the store reads and writes, as dataclasses, and how a job's hash, text and log read as
its record (both stores share these pure parts). A job's parts are read in common/store/parts.py;
the arguments of each script call and the parsers of their replies are in common/store/calls.py.

The hash, the log and the text key:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis

from common.keys import Keys
from common.schemas.checks import STORED_CONTEXT
from common.schemas.events import DoneEvent, LogEntry, TokenEvent, TokenLogprob
from common.schemas.requests import ImagePart, JobRequest
from common.schemas.views import Job, JobError, JobStatus, JobSummary, Usage, WorkerHeartbeat
from common.settings import Settings


@dataclass(frozen=True)
class JobRecord:
    """Everything stored about a job: the API view plus what only the server needs."""

    job: Job
    request: JobRequest | ImagePart  # an image part's hash holds an ImagePart
    owner: str  # API key hash; empty without keys
    attempt: int
    worker: str
    cancel_requested: bool
    batch: str = ""  # the batch whose line it is (api/batch_feeder.py); empty for any other job
    # A part of a foreground job: its worker cancels the job once nobody watches it (workers/liveness.py).
    foreground_parent: bool = False
    # A held image part: when its message was sent (unix s; its job's text parts' first tokens, or the bound).
    released_at: float | None = None


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
        """Whether its streams count as watchers (a job nobody watches is cancelled: api/watchers.py)."""
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
    text_seq: int = 0  # TAKEN: how many of them the text key covers (the writer's last checkpoint)


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
    content: bytes = b""  # a part's artifact (an image's PNG), stored with its final append
    # A checkpoint writes the text key and the hash's counts (append_step.lua); the writer sends
    # one every TEXT_CHECKPOINT_EVENTS events, with a job's first and last append. ``unsaved_text``
    # is then the text of every token event since the last checkpoint, these included (None:
    # these entries' own). Parts ignore both (part_append.lua writes at every append).
    checkpoint: bool = True
    unsaved_text: str | None = None


class Appended(str, enum.Enum):
    """What became of one Append (its answer in append_step.lua's reply)."""

    WRITTEN = "written"  # written now, or by an earlier try of the same append
    FENCED = "fenced"  # another worker took the job over (its attempt moved on)
    GAP = "gap"  # still this attempt's, but the log does not end just before the first entry

    @classmethod
    def of(cls, reply: int) -> Appended:
        return {1: cls.WRITTEN, 2: cls.WRITTEN, 0: cls.FENCED}.get(reply, cls.GAP)


ScriptCall = tuple[list[str], list[Any]]  # (KEYS, ARGV) of one Lua script call

# How many log entries a text job's writer lets pass between two checkpoints of its text key and
# counts: a reader of a running job decodes at most this many entries of its log, and the
# checkpoints cost 2 Redis commands per this many events (docs/internals.md, "Redis").
TEXT_CHECKPOINT_EVENTS = 16


JOB_ID_BYTES = 16  # 128 random bits: a job id is its own capability, so it must not be guessable


def oldest_page(keys: Keys, count: int) -> int:
    """How many of each bucket's queued set to read for the ``count`` jobs queued longest of all
    (``oldest_of``): all ``count`` from one bucket, about twice its share from each of several."""
    return count if keys.buckets == 1 else max(16, 2 * count // keys.buckets)


def oldest_of(pages: Sequence[Sequence[tuple[Any, float]]], per: int, count: int) -> list[str]:
    """The ``count`` oldest ids of the buckets' queued sets, oldest first, from a page of ``per``
    (id, score) of each. Past the newest entry of a full page another bucket may hold older jobs
    unread, so the list stops there: a prefix of the true order, short rather than wrong."""
    cut = min((page[-1][1] for page in pages if len(page) >= per), default=float("inf"))
    merged = sorted((score, str(j)) for page in pages for j, score in page if score <= cut)
    return [j for _, j in merged[:count]]


def new_job_id(keys: Keys, bucket: int | None = None) -> str:
    """A new job's id, in ``bucket`` (any if None: common/keys.py on buckets)."""
    return keys.new_id("", JOB_ID_BYTES, bucket)


def new_job_fields(job_id: str, request: JobRequest, owner: str, now: float) -> dict[str, str]:
    # The batch tier's jobs are marked: a worker's intake takes interactive jobs only.
    tier = {"tier": "flex"} if isinstance(request, JobRequest) and request.service_tier == "flex" else {}
    return {
        **tier,
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
    queue: str = ""  # the Celery queue: stored in the job's hash, for its requeues (workers/reaper.py)


MessageFor = Callable[[str], QueueMessage]  # a job id -> the message that hands it to the workers
# An image part's id, and whether it is held (``held_parts``) -> its message.
MediaMessageFor = Callable[[str, bool], QueueMessage]

OWNER_INDEX_MAX = 10_000  # newest jobs an owner's index (GET /v1/jobs) keeps


def owner_index_age_s(settings: Settings) -> int:
    """How long an owner's index keeps a job: its TTL after it ends, and as long again for the
    time it was queued and ran (a job whose hash expired meanwhile is skipped when listed)."""
    return 2 * settings.job_ttl_s


def float_or_none(v: str | None) -> float | None:
    return float(v) if v else None


def job_text(log: Iterable[LogEntry]) -> str:
    """The job's text: its token events' (a job with n > 1: choice 0's, the other choices are
    in the log only)."""
    return "".join(e.data["text"] for e in log if e.type == "token" and not e.data.get("choice"))


def decode_log(raw: Iterable[str | bytes]) -> list[LogEntry]:
    return [LogEntry.decode(r) for r in raw]


P = TypeVar("P", redis.client.Pipeline, aredis.client.Pipeline)


def record_reads(pipe: P, keys: Keys, job_id: str) -> P:
    """Queue the reads of a job's record: its hash, its text and its log's length.

    In this order, in a pipeline without MULTI: Redis out of memory refuses every command
    queued in a MULTI, reads included, and reads must go on then. The order makes the reads
    consistent: a checkpoint (append_step.lua) writes the text and the hash's ``text_seq`` and
    ``text_len`` at once, and the text only grows, so the hash's ``text_len`` bytes of a text
    read after it are the text of the log's first ``text_seq`` entries, and a log read after
    both holds at least those (``text_read``).
    """
    pipe.hgetall(keys.job(job_id))
    pipe.get(keys.job_text(job_id))
    pipe.llen(keys.job_log(job_id))
    return pipe


def text_read(h: Mapping[str, str], text: str | None, logged: int) -> tuple[str, int] | None:
    """A text job's text from the reads of ``record_reads``, and from which seq its log must be
    read for the rest (0: nothing to read); None when it has no text key to start from (cancelled
    while queued: its log is the one done event; or its key was lost) and the whole log is read.

    The text key covers the log's first ``text_seq`` entries with its first ``text_len`` bytes.
    Without ``text_seq`` (a job with parts: part_append.lua appends at every event) it is the
    whole text.
    """
    if text is None:
        return None if logged else ("", 0)
    if "text_seq" not in h:
        return text, 0
    covered, size = int(h["text_seq"]), int(h["text_len"])
    raw = text.encode()
    if len(raw) > size:
        text = raw[:size].decode()
    return text, covered if logged > covered else 0


def with_log_tail(record: JobRecord, tail: Sequence[LogEntry]) -> JobRecord:
    """A running job's record with the events after its last checkpoint: their text, and their
    tokens in its usage (the hash's counts are the checkpoint's). An ended job's last append is
    a checkpoint, so its record needs none."""
    if not tail:
        return record
    job = record.job
    added = sum(len(e.data["token_ids"]) for e in tail if e.type == "token")
    update: dict[str, Any] = {"text": job.text + job_text(tail)}
    if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
        update["usage"] = Usage.of(job.usage.prompt_tokens, job.usage.completion_tokens + added)
    return replace(record, job=job.model_copy(update=update))


SUMMARY_FIELDS = (
    "id", "status", "finish_reason", "prompt_tokens", "completion_tokens", "error",
    "created_at", "started_at", "finished_at", "model", "parts", "batch",
)  # fmt: skip
LIST_SCAN_MAX = 1000  # index entries one GET /v1/jobs reads at most (a status filter skips some)


def summary_from_hash(h: Mapping[str, str | None]) -> JobSummary:
    prompt_tokens, completion_tokens = int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0)
    error = h.get("error")
    return JobSummary(
        id=str(h["id"]),
        status=JobStatus(h["status"]),
        finish_reason=h.get("finish_reason") or None,
        usage=Usage.of(prompt_tokens, completion_tokens),
        error=JobError.model_validate_json(error) if error else None,
        created_at=float(str(h["created_at"])),
        started_at=float_or_none(h.get("started_at")),
        finished_at=float_or_none(h.get("finished_at")),
        model=h.get("model") or None,
        batch_id=h.get("batch") or None,
    )


def record_from_hash(h: dict[str, str], text: str) -> JobRecord:
    job = Job(**dict(summary_from_hash(h)), text=text)
    request: JobRequest | ImagePart = (
        ImagePart.model_validate_json(h["request"])
        if h.get("type") == "image"
        else JobRequest.model_validate_json(h["request"], context=STORED_CONTEXT)
    )
    return JobRecord(
        job=job,
        request=request,
        owner=h.get("owner", ""),
        attempt=int(h.get("attempt") or 0),
        worker=h.get("worker", ""),
        cancel_requested=h.get("cancel_requested") == "1",
        batch=h.get("batch", ""),
        foreground_parent=h.get("foreground") == "1",
        released_at=float(h["released_at"]) if h.get("released_at") else None,
    )


def cancelled_done_entry() -> LogEntry:
    """The terminal event of a job cancelled while queued (its log is empty, so seq 1)."""
    return LogEntry.done(
        1, DoneEvent(status=JobStatus.CANCELLED, finish_reason="cancelled", usage=Usage.of(0, 0))
    )


# NOTE: liveness is the heartbeat key's TTL (a lapsed worker's key reads as None below); the
# registry only lists names to look at, and forgets a worker after an hour without a beat.
WORKER_FORGET_S = 3600.0


def worker_keys(keys: Keys, names: Iterable[str]) -> list[str]:
    return [keys.worker(n) for n in names]


def heartbeats_from(values: Iterable[str | bytes | None]) -> list[WorkerHeartbeat]:
    # NOTE: a key can expire between SCAN and MGET; it then reads as None.
    return [WorkerHeartbeat.model_validate_json(v) for v in values if v]


def token_entry(
    seq: int,
    index: int,
    text: str,
    token_ids: Sequence[int],
    logprobs: list[TokenLogprob] | None = None,
    choice: int | None = None,
    finish_reason: str | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
    prompt_tokens: Sequence[str] | None = None,
) -> LogEntry:
    return LogEntry.token(
        seq,
        TokenEvent(
            index=index,
            text=text,
            token_ids=list(token_ids),
            logprobs=logprobs,
            choice=choice,
            finish_reason=finish_reason,
            prompt_logprobs=prompt_logprobs,
            prompt_tokens=None if prompt_tokens is None else list(prompt_tokens),
        ),
    )
