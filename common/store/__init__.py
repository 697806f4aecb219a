"""The job store: jobs, their event logs, watcher sets and worker heartbeats in Redis.

The only code of Spool that writes Redis (Celery's broker and kombu write their own keys).
``SyncJobStore`` (the worker, ``redis.Redis``) and
``AsyncJobStore`` (the API, ``redis.asyncio``) are thin shells over the same pure parts:

- ``errors``: what the stores raise on purpose;
- ``records``: the dataclasses read and written, and a job's hash and text read as its record;
- ``parts``: a job's parts, read and shown;
- ``calls``: each Lua call's arguments and each reply's parser;
- ``scripts``: the Lua scripts (common/store/lua/*.lua: every status transition and every append is one);
- ``watchers``: who watches a foreground job (the API writes, a worker reads);
- ``cancels``: the worker's listener on the cancel channel;
- ``clients``: the Redis clients' retries, timeouts and pool;
- ``sync`` and ``aio``: the two stores;
- ``files`` and ``batches``: the API's files and batches.

Every key the stores write:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from common.store.aio import AsyncJobStore
from common.store.batches import (
    BATCH_LINE_STATES,
    SPILL_LINES,
    AsyncBatchStore,
    BatchCounts,
    LineJob,
    LineResult,
)
from common.store.calls import (
    append_step_args,
    cancel_args,
    check_cancel,
    check_created,
    check_replay,
    create_call,
    create_parts_call,
    parse_take,
    part_append_args,
    part_take_args,
    take_args,
)
from common.store.errors import (
    Conflict,
    IdempotencyConflict,
    JobNotFound,
    KeyQueueFull,
    QueueFull,
    StoreError,
)
from common.store.files import NO_BYTES_LEFT, NO_FILE_LEFT, RESERVED, FenceLost, Reservation, Usage
from common.store.parts import as_part_entry, own_events, part_reads, with_parts
from common.store.records import (
    JOB_ID_BYTES,
    TEXT_CHECKPOINT_EVENTS,
    WORKER_FORGET_S,
    Append,
    Appended,
    Final,
    JobRecord,
    MediaMessageFor,
    MessageFor,
    QueueMessage,
    ScriptCall,
    StreamState,
    TakeResult,
    TakeStatus,
    cancelled_done_entry,
    decode_log,
    heartbeats_from,
    job_text,
    new_job_fields,
    new_job_id,
    record_from_hash,
    record_reads,
    text_read,
    token_entry,
    with_log_tail,
    worker_keys,
)
from common.store.sync import SyncJobStore
from common.store.watchers import WatcherSets, watching

__all__ = [
    "JOB_ID_BYTES",
    "SPILL_LINES",
    "WORKER_FORGET_S",
    "Append",
    "Appended",
    "AsyncBatchStore",
    "BATCH_LINE_STATES",
    "AsyncJobStore",
    "Conflict",
    "Final",
    "IdempotencyConflict",
    "JobNotFound",
    "JobRecord",
    "BatchCounts",
    "LineJob",
    "LineResult",
    "FenceLost",
    "Usage",
    "Reservation",
    "NO_FILE_LEFT",
    "NO_BYTES_LEFT",
    "RESERVED",
    "MediaMessageFor",
    "MessageFor",
    "QueueFull",
    "KeyQueueFull",
    "QueueMessage",
    "ScriptCall",
    "StoreError",
    "TEXT_CHECKPOINT_EVENTS",
    "StreamState",
    "SyncJobStore",
    "TakeResult",
    "TakeStatus",
    "WatcherSets",
    "append_step_args",
    "as_part_entry",
    "cancel_args",
    "cancelled_done_entry",
    "check_cancel",
    "check_created",
    "check_replay",
    "create_call",
    "create_parts_call",
    "decode_log",
    "heartbeats_from",
    "job_text",
    "new_job_fields",
    "new_job_id",
    "own_events",
    "parse_take",
    "part_append_args",
    "part_reads",
    "part_take_args",
    "record_from_hash",
    "record_reads",
    "take_args",
    "text_read",
    "token_entry",
    "watching",
    "with_log_tail",
    "with_parts",
    "worker_keys",
]
