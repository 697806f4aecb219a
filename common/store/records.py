"""What the store reads and writes, as dataclasses, and the pure parts both stores share: the
arguments of each Lua script call (common/store/lua.py) and the parsers of the replies."""

from __future__ import annotations

import enum
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from pydantic_core import to_json

from common.keys import Keys, part_id, split_part_id
from common.schemas import (
    DoneEvent,
    ImagePart,
    Job,
    JobError,
    JobRequest,
    JobStatus,
    JobSummary,
    LogEntry,
    TokenEvent,
    TokenLogprob,
    Usage,
    WorkerHeartbeat,
)
from common.settings import Settings
from common.store.errors import Conflict, IdempotencyConflict, JobNotFound, QueueFull
from common.store.hooks import hook_field


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
    # A checkpoint writes the text key and the hash's counts (APPEND_STEP_LUA); the writer sends
    # one every TEXT_CHECKPOINT_EVENTS events, with a job's first and last append. ``unsaved_text``
    # is then the text of every token event since the last checkpoint, these included (None:
    # these entries' own). Parts ignore both (PART_APPEND_LUA writes at every append).
    checkpoint: bool = True
    unsaved_text: str | None = None


class Appended(str, enum.Enum):
    """What became of one Append (its answer in APPEND_STEP_LUA's reply)."""

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


def new_job_id() -> str:
    return secrets.token_hex(JOB_ID_BYTES)


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


def job_hook(keys: Keys, settings: Settings, job_id: str, request: JobRequest, owner: str) -> str:
    """A job's ``hook`` field: its webhook's and its owner's endpoints' (common/store/hooks.py)."""
    return hook_field(
        keys,
        settings,
        "job",
        job_id,
        request.webhook,
        request.webhook_events,
        owner,
        request.events_of,
        request.endpoints,
    )


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
    if request.webhook is not None or request.endpoints:
        fields["hook"] = job_hook(keys, settings, job_id, request, owner)
    message = message_for(job_id) if message_for else None
    if message:
        fields["queue"] = message.queue
    flat = [x for kv in fields.items() for x in kv]
    script_keys = [keys.queued_jobs(), keys.job(job_id), keys.owner_jobs(owner)]
    script_keys += [message.list_key] if message else []
    # An idempotency key is remembered as long as a finished job (its job outlives it).
    idem_ttl: int | str = ""
    if idempotency_key is not None:
        script_keys.append(keys.idempotency(owner, idempotency_key))
        idem_ttl = settings.job_ttl_s
    payload = message.payload if message else ""
    index = [owner_index_age_s(settings), OWNER_INDEX_MAX]
    return fields, (
        script_keys,
        [settings.max_queued_jobs, job_id, repr(now), payload, idem_ttl, *index, *flat],
    )


OWNER_INDEX_MAX = 10_000  # newest jobs an owner's index (GET /v1/jobs) keeps


def owner_index_age_s(settings: Settings) -> int:
    """How long an owner's index keeps a job: its TTL after it ends, and as long again for the
    time it was queued and ran (a job whose hash expired meanwhile is skipped when listed)."""
    return 2 * settings.job_ttl_s


def held_parts(parts: Sequence[Any], hold_s: float) -> list[int]:
    """The image parts whose message waits for their job's text parts' first tokens (or their end),
    at most ``hold_s`` (SPOOL_IMAGE_HOLD_S): those with a prompt of their own in a job with text
    parts (a ``prompt_from`` part waits for its text part's end anyway)."""
    if hold_s <= 0 or not any(p.type == "text" for p in parts):
        return []
    return [k for k, p in enumerate(parts) if isinstance(p, ImagePart) and p.prompt_from is None]


def create_parts_call(
    keys: Keys,
    settings: Settings,
    request: JobRequest,
    owner: str,
    message_for: MessageFor | None,
    media_message_for: MediaMessageFor | None,
    idempotency_key: str | None,
) -> tuple[dict[str, str], ScriptCall]:
    """A new job with parts: its fields, and the call of CREATE_PARTS_LUA that stores it with its
    parts (each a hash of its own, run as a job by its kind of worker) and their messages."""
    assert request.parts is not None
    now, job_id = time.time(), new_job_id()
    fields = new_job_fields(job_id, request, owner, now)
    if request.webhook is not None or request.endpoints:
        fields["hook"] = job_hook(keys, settings, job_id, request, owner)
    ids = [part_id(job_id, k) for k in range(len(request.parts))]
    fields["parts"] = str(len(ids))
    fields["part_keys"] = json.dumps([[keys.job(i), keys.job_text(i), keys.part_content(i)] for i in ids])
    dependents: dict[int, list[int]] = {}
    for k, part in enumerate(request.parts):
        if isinstance(part, ImagePart) and part.prompt_from is not None:
            dependents.setdefault(part.prompt_from, []).append(k)
    held = held_parts(request.parts, settings.image_hold_s)
    if held:
        fields["held_parts"] = json.dumps(held)
        fields["text_waiting"] = str(sum(part.type == "text" for part in request.parts))
    parts = []
    for k, (pid, part) in enumerate(zip(ids, request.parts, strict=True)):
        text = part.type == "text"
        pf = new_job_fields(pid, request.part_request(k), owner, now)  # type: ignore[arg-type]
        pf.update(type=part.type, index=str(k), parent=job_id, logged="0")
        if not request.background:
            pf["foreground"] = "1"
        if k in dependents:
            pf["dependents"] = json.dumps(dependents[k])
        if text and held:
            pf["holds"] = "1"  # its first event (token or end) counts toward sending the held parts
        if text:
            message = message_for(pid) if message_for else None
        else:
            message = media_message_for(pid, k in held) if media_message_for else None
        waits = (isinstance(part, ImagePart) and part.prompt_from is not None) or k in held
        push = message is not None and not waits
        if k in held and message is not None:  # sent at the text parts' first tokens, or at this bound
            assert isinstance(part, ImagePart)
            zset, score = keys.held_media(), now + min(settings.image_hold_s, part.timeout_s or math.inf)
        else:
            zset, score = (keys.queued_jobs() if text else keys.queued_media() if push else ""), now
        if message is not None:
            pf.update(list_key=message.list_key, message=message.payload, queue=message.queue)
        parts.append(
            {
                "id": pid,
                "key": keys.job(pid),
                "fields": pf,
                "zset": zset,
                "score": repr(score),
                "push": push,
                "list": message.list_key if message else "",
                "message": message.payload if message else "",
            }
        )
    script_keys = [keys.queued_jobs(), keys.job(job_id), keys.owner_jobs(owner)]
    idem_ttl: int | str = ""
    if idempotency_key is not None:
        script_keys.append(keys.idempotency(owner, idempotency_key))
        idem_ttl = settings.job_ttl_s
    index = [owner_index_age_s(settings), OWNER_INDEX_MAX]
    args = [
        settings.max_queued_jobs,
        job_id,
        repr(now),
        idem_ttl,
        json.dumps(fields),
        json.dumps(parts),
        *index,
    ]
    return fields, (script_keys, args)


def _float_or_none(v: str | None) -> float | None:
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
    consistent: a checkpoint (APPEND_STEP_LUA) writes the text and the hash's ``text_seq`` and
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

    The text key covers the log's first ``text_seq`` entries with its first ``text_len`` bytes;
    a job written before checkpoints (no ``text_seq``) appended its text at every event.
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
        started_at=_float_or_none(h.get("started_at")),
        finished_at=_float_or_none(h.get("finished_at")),
        model=h.get("model") or None,
        batch_id=h.get("batch") or None,
    )


def record_from_hash(h: dict[str, str], text: str) -> JobRecord:
    job = Job(**dict(summary_from_hash(h)), text=text)
    request: JobRequest | ImagePart = (
        ImagePart.model_validate_json(h["request"])
        if h.get("type") == "image"
        else JobRequest.model_validate_json(h["request"])
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


def part_reads(pipe: P, keys: Keys, job_id: str, n: int) -> P:
    """Queue the reads of a job's parts: each one's hash and text."""
    for k in range(n):
        pipe.hgetall(keys.job(part_id(job_id, k)))
        pipe.get(keys.job_text(part_id(job_id, k)))
    return pipe


IMAGE_RESULT = ("url", "content_type", "width", "height", "seed")  # an image part's summary fields shown


def part_view(h: dict[str, str], text: str | None) -> dict[str, Any]:
    """A part as ``Job.parts`` shows it (docs/internals.md, "Parts")."""
    view: dict[str, Any] = {
        "index": int(h["index"]),
        "type": h["type"],
        "status": h["status"],
        "error": json.loads(h["error"]) if h.get("error") else None,
        "attempt": int(h.get("attempt") or 0),
        "started_at": _float_or_none(h.get("started_at")),
        "finished_at": _float_or_none(h.get("finished_at")),
    }
    if h["type"] == "text":
        usage = Usage.of(int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0))
        view.update(text=text or "", finish_reason=h.get("finish_reason") or None, usage=usage.model_dump())
    else:
        summary = json.loads(h["summary"]) if h.get("summary") else {}
        view.update({k: summary[k] for k in IMAGE_RESULT if k in summary})
    return view


def summary_with_parts(summary: JobSummary, hashes: Sequence[dict[str, str]]) -> JobSummary:
    """A listed job's summary with its parts' views (without their texts), usage their sum."""
    parts = [{k: v for k, v in part_view(h, None).items() if k != "text"} for h in hashes if h]
    usages = [p["usage"] for p in parts if "usage" in p]
    usage = Usage.of(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages))
    return summary.model_copy(update={"parts": parts, "usage": usage})


def with_parts(record: JobRecord, hashes: Sequence[dict[str, str]], texts: Sequence[str | None]) -> JobRecord:
    """A job's record with its parts' views, and its usage their sum."""
    parts = [part_view(h, t) for h, t in zip(hashes, texts, strict=True) if h]
    usages = [p["usage"] for p in parts if "usage" in p]
    usage = Usage.of(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages))
    job = record.job.model_copy(update={"parts": parts, "usage": usage})
    return JobRecord(
        job, record.request, record.owner, record.attempt, record.worker, record.cancel_requested
    )


def take_args(keys: Keys, job_id: str, worker: str, model: str, now: float, lease_s: float) -> ScriptCall:
    return (
        [
            keys.job(job_id),
            keys.job_log(job_id),
            keys.queued_jobs(),
            keys.running_jobs(),
            keys.job_text(job_id),
            keys.attempts(),
        ],
        [job_id, worker, model, repr(now), repr(now + lease_s)],
    )


def part_take_args(keys: Keys, pid: str, worker: str, model: str, now: float, lease_s: float) -> ScriptCall:
    split = split_part_id(pid)
    assert split is not None
    job_id, index = split
    return (
        [
            keys.job(pid),
            keys.job_log(job_id),
            keys.queued_jobs(),
            keys.running_jobs(),
            keys.job(job_id),
            keys.job_events(job_id),
            keys.queued_media(),
        ],
        [pid, worker, model, repr(now), repr(now + lease_s), index],
    )


def own_events(log: Iterable[LogEntry], index: int) -> list[LogEntry]:
    """A part's own events (tokens, progress, previews) in the job's log, numbered as the part counts them:
    what its worker resumes from, as a text job's worker does from its log."""
    mine = [e for e in log if e.type in ("token", "progress", "preview") and e.data.get("part") == index]
    return [e.model_copy(update={"seq": n}) for n, e in enumerate(mine, 1)]


def parse_take(reply: list[Any], part_index: int | None = None) -> TakeResult:
    status = TakeStatus(reply[0])
    if status is not TakeStatus.TAKEN:
        return TakeResult(status)
    h = _pairs(reply[2])
    log = decode_log(reply[3])
    if part_index is not None:
        log = own_events(log, part_index)
    return TakeResult(
        status,
        attempt=int(reply[1]),
        record=record_from_hash(h, job_text(log)),
        log=log,
        text_seq=int(h.get("text_seq") or 0) if part_index is None else 0,
    )


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def as_part_entry(entry: LogEntry, index: int) -> LogEntry:
    """A text worker's entry for a text part: tokens carry the part; the terminal event becomes
    the part's end (the job's own done comes once every part has ended)."""
    data = entry.data
    if entry.type == "token":
        return entry.model_copy(update={"data": {"part": index, **data}})
    if entry.type == "done":
        end = {
            "part": index,
            "status": data["status"],
            "finish_reason": data["finish_reason"],
            "usage": data["usage"],
        }
        return LogEntry.part_status(entry.seq, end)
    if entry.type == "error":
        error = {"message": data["message"], "type": data["type"]}
        return LogEntry.part_status(entry.seq, {"part": index, "status": "failed", "error": error})
    return entry


def part_append_args(keys: Keys, a: Append, ttl_s: int, now: float) -> ScriptCall:
    split = split_part_id(a.job_id)
    assert split is not None
    job_id, index = split
    final = a.final
    entries = [as_part_entry(e, index) for e in a.entries]
    summary = to_json(entries[-1].data).decode() if final and entries else ""
    return (
        [
            keys.job(a.job_id),
            keys.job_log(job_id),
            keys.job_events(job_id),
            keys.running_jobs(),
            keys.job_text(a.job_id),
            keys.job(job_id),
            keys.job_text(job_id),
            keys.part_content(a.job_id),
            keys.queued_media(),
            keys.held_media(),
        ],
        [
            str(a.attempt),
            entries[0].seq if entries else 0,
            a.prompt_tokens,
            a.completion_tokens,
            final.status.value if final else "",
            (final.finish_reason or "") if final else "",
            repr(now),
            final.error.model_dump_json() if final and final.error else "",
            ttl_s,
            a.job_id,
            job_text(entries),
            summary,
            a.content,
            index,
            *(e.encode() for e in entries),
        ],
    )


def append_step_args(keys: Keys, appends: Sequence[Append], ttl_s: int, now: float) -> ScriptCall:
    """APPEND_STEP_LUA's call: every append of a step (or of several steps, in order) at once."""
    script_keys, args = [keys.running_jobs(), keys.attempts()], [ttl_s, repr(now)]
    for a in appends:
        script_keys += [
            keys.job(a.job_id),
            keys.job_log(a.job_id),
            keys.job_events(a.job_id),
            keys.job_text(a.job_id),
        ]
        args += _append_args(a)
    return script_keys, args


def _append_args(a: Append) -> list[Any]:
    final = a.final
    return [
        str(a.attempt),
        a.entries[0].seq if a.entries else 0,
        a.prompt_tokens,
        a.completion_tokens,
        final.status.value if final else "",
        (final.finish_reason or "") if final else "",
        final.error.model_dump_json() if final and final.error else "",
        a.job_id,
        "1" if a.checkpoint or final else "",
        job_text(a.entries) if a.unsaved_text is None else a.unsaved_text,
        len(a.entries),
        *(e.encode() for e in a.entries),
    ]


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
            keys.running_jobs(),
            keys.job_text(job_id),
            keys.queued_media(),
            keys.held_media(),
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
        ),
    )
