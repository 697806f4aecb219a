"""The arguments of each Lua script call of the job store, and the parsers of the replies.

Each file of common/store/lua/ declares what its call passes in its ``KEYS`` and ``ARGV`` lines,
and its header is the script's contract. How the files are read:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

from pydantic_core import to_json

from common.keys import Keys, part_id, split_part_id
from common.schemas.events import ErrorEvent, LogEntry
from common.schemas.requests import ImagePart, JobRequest
from common.schemas.views import Job, JobError
from common.settings import Settings
from common.store.errors import Conflict, IdempotencyConflict, JobNotFound, KeyQueueFull, QueueFull
from common.store.hooks import hook_field
from common.store.parts import as_part_entry, held_parts, own_events
from common.store.records import (
    OWNER_INDEX_MAX,
    Append,
    JobRecord,
    MediaMessageFor,
    MessageFor,
    ScriptCall,
    TakeResult,
    TakeStatus,
    cancelled_done_entry,
    decode_log,
    job_text,
    new_job_fields,
    new_job_id,
    owner_index_age_s,
    record_from_hash,
)
from common.tenants import tenant_of


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


def queued_limit(keys: Keys, settings: Settings) -> int:
    """How many jobs a bucket's queued set takes (create.lua): SPOOL_MAX_QUEUED_JOBS split evenly
    between the buckets, since a script sees its own bucket's set only."""
    return -(-settings.max_queued_jobs // keys.buckets)


def owner_queued_limit(keys: Keys, settings: Settings, owner: str) -> int | str:
    """How many of an owner's jobs a bucket's queued set takes (create.lua): its
    SPOOL_MAX_QUEUED_JOBS_PER_KEY (or its tenant's) split evenly between the buckets, as
    ``queued_limit``; '' without an owner (no API keys: one tenant, SPOOL_MAX_QUEUED_JOBS bounds it)."""
    if not owner:
        return ""
    return -(-settings.max_queued_of(tenant_of(owner)) // keys.buckets)


def _new_id(keys: Keys, owner: str, idempotency_key: str | None) -> tuple[str, int]:
    """A new job's id and bucket: the bucket of its idempotency key (create.lua checks the key and
    writes the job at once), or any."""
    bucket = None if idempotency_key is None else keys.idempotency_bucket(owner, idempotency_key)
    job_id = new_job_id(keys, bucket)
    return job_id, keys.bucket_of(job_id)


def create_call(
    keys: Keys,
    settings: Settings,
    request: JobRequest,
    owner: str,
    message_for: MessageFor | None,
    idempotency_key: str | None,
) -> tuple[dict[str, str], ScriptCall]:
    """A new job's fields, and the create script's call that stores them."""
    now, (job_id, bucket) = time.time(), _new_id(keys, owner, idempotency_key)
    fields = new_job_fields(job_id, request, owner, now)
    if request.webhook is not None or request.endpoints:
        fields["hook"] = job_hook(keys, settings, job_id, request, owner)
    message = message_for(job_id) if message_for else None
    if message:
        fields["queue"] = message.queue
    flat = [x for kv in fields.items() for x in kv]
    script_keys = [
        keys.queued_jobs(bucket),
        keys.job(job_id),
        keys.owner_jobs(owner, bucket),
        keys.owner_queued(owner, bucket),
    ]
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
        [
            queued_limit(keys, settings),
            owner_queued_limit(keys, settings, owner),
            job_id,
            repr(now),
            payload,
            idem_ttl,
            *index,
            *flat,
        ],
    )


def create_parts_call(
    keys: Keys,
    settings: Settings,
    request: JobRequest,
    owner: str,
    message_for: MessageFor | None,
    media_message_for: MediaMessageFor | None,
    idempotency_key: str | None,
) -> tuple[dict[str, str], ScriptCall]:
    """A new job with parts: its fields, and the call of create_parts.lua that stores it with its
    parts (each a hash of its own, run as a job by its kind of worker) and their messages."""
    assert request.parts is not None
    now, (job_id, bucket) = time.time(), _new_id(keys, owner, idempotency_key)
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
            zset, score = (
                keys.held_media(bucket),
                now + min(settings.image_hold_s, part.timeout_s or math.inf),
            )
        else:
            zset, score = (
                (keys.queued_jobs(bucket) if text else keys.queued_media(bucket) if push else ""),
                now,
            )
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
    script_keys = [
        keys.queued_jobs(bucket),
        keys.job(job_id),
        keys.owner_jobs(owner, bucket),
        keys.owner_queued(owner, bucket),
    ]
    idem_ttl: int | str = ""
    if idempotency_key is not None:
        script_keys.append(keys.idempotency(owner, idempotency_key))
        idem_ttl = settings.job_ttl_s
    index = [owner_index_age_s(settings), OWNER_INDEX_MAX]
    args = [
        queued_limit(keys, settings),
        owner_queued_limit(keys, settings, owner),
        job_id,
        repr(now),
        idem_ttl,
        json.dumps(fields),
        json.dumps(parts),
        *index,
    ]
    return fields, (script_keys, args)


def take_args(keys: Keys, job_id: str, worker: str, model: str, now: float, lease_s: float) -> ScriptCall:
    bucket = keys.bucket_of(job_id)
    return (
        [
            keys.job(job_id),
            keys.job_log(job_id),
            keys.queued_jobs(bucket),
            keys.running_jobs(bucket),
            keys.job_text(job_id),
            keys.attempts(bucket),
        ],
        [job_id, worker, model, repr(now + lease_s)],
    )


def part_take_args(keys: Keys, pid: str, worker: str, model: str, now: float, lease_s: float) -> ScriptCall:
    split = split_part_id(pid)
    assert split is not None
    job_id, index = split
    bucket = keys.bucket_of(job_id)
    return (
        [
            keys.job(pid),
            keys.job_log(job_id),
            keys.queued_jobs(bucket),
            keys.running_jobs(bucket),
            keys.job(job_id),
            keys.job_events(job_id),
            keys.queued_media(bucket),
        ],
        [pid, worker, model, repr(now + lease_s), index],
    )


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


def part_append_args(keys: Keys, a: Append, ttl_s: int) -> ScriptCall:
    split = split_part_id(a.job_id)
    assert split is not None
    job_id, index = split
    bucket = keys.bucket_of(job_id)
    final = a.final
    entries = [as_part_entry(e, index) for e in a.entries]
    summary = to_json(entries[-1].data).decode() if final and entries else ""
    return (
        [
            keys.job(a.job_id),
            keys.job_log(job_id),
            keys.job_events(job_id),
            keys.running_jobs(bucket),
            keys.job_text(a.job_id),
            keys.job(job_id),
            keys.job_text(job_id),
            keys.part_content(a.job_id),
            keys.queued_media(bucket),
            keys.held_media(bucket),
        ],
        [
            str(a.attempt),
            entries[0].seq if entries else 0,
            a.prompt_tokens,
            a.completion_tokens,
            final.status.value if final else "",
            (final.finish_reason or "") if final else "",
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


def append_step_args(keys: Keys, appends: Sequence[Append], ttl_s: int) -> ScriptCall:
    """append_step.lua's call: every append of a step (or of several steps, in order) of these
    jobs at once, in as many groups as they have buckets (on a Redis Cluster the caller passes
    jobs whose buckets lie on one master: common/store/steps.py)."""
    groups: dict[int, int] = {}  # bucket -> its group, 1-based
    job_keys: list[str] = []
    job_args: list[Any] = []
    for a in appends:
        assert a.entries, f"an append of job {a.job_id} without entries"  # the script needs one
        group = groups.setdefault(keys.bucket_of(a.job_id), len(groups) + 1)
        job_keys += [
            keys.job(a.job_id),
            keys.job_log(a.job_id),
            keys.job_events(a.job_id),
            keys.job_text(a.job_id),
        ]
        job_args += [group, *_append_args(a)]
    bucket_keys = [k for b in groups for k in (keys.running_jobs(b), keys.attempts(b))]
    return bucket_keys + job_keys, [ttl_s, len(groups), *job_args]


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


def cancel_args(keys: Keys, job_id: str, ttl_s: int) -> ScriptCall:
    bucket = keys.bucket_of(job_id)
    return (
        [
            keys.job(job_id),
            keys.job_log(job_id),
            keys.job_events(job_id),
            keys.queued_jobs(bucket),
            keys.job_text(job_id),
            keys.queued_media(bucket),
            keys.held_media(bucket),
        ],
        [job_id, ttl_s, cancelled_done_entry().encode(), keys.cancelled()],
    )


MODEL_NOT_SERVED = "model_not_served"  # the error type of a job failed for want of its model's workers


def unserved_args(keys: Keys, job_id: str, queue: str, to: str, ttl_s: int, message: str) -> ScriptCall:
    """unserved.lua's call: move a queued job of ``queue`` to the queue ``to``, or ('' ) fail it
    with ``model_not_served`` and ``message``."""
    bucket = keys.bucket_of(job_id)
    error = JobError(message=message, type=MODEL_NOT_SERVED)
    entry = LogEntry.error(1, ErrorEvent(message=message, type=MODEL_NOT_SERVED))
    return (
        [keys.job(job_id), keys.job_log(job_id), keys.job_events(job_id), keys.queued_jobs(bucket)],
        [job_id, queue, to, ttl_s, entry.encode(), error.model_dump_json()],
    )


def check_cancel(reply: str, job_id: str) -> None:
    if reply == "missing":
        raise JobNotFound(job_id)
    if reply not in ("cancelled", "requested"):
        raise Conflict(f"job {job_id!r} already finished with status {reply!r}")


def check_created(reply: int | str, max_queued: int, max_owner_queued: int = 0) -> str | None:
    """None when the job was created; the id of the earlier job its idempotency key names.
    QueueFull when the queue is full, KeyQueueFull when the owner's share of it is."""
    if isinstance(reply, str):
        return reply
    if reply == -1:
        raise KeyQueueFull(max_owner_queued)
    if not reply:
        raise QueueFull(max_queued)
    return None


def check_replay(earlier: JobRecord, request: JobRequest) -> Job:
    """The earlier job of an idempotency key, if it was created for the same request."""
    if earlier.request.model_dump_json() != request.model_dump_json():
        raise IdempotencyConflict(earlier.job.id)
    return earlier.job
