"""The API's store, over ``redis.asyncio``: create, read, cancel and stream jobs; watcher sets.

Every key it writes: docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aredis
from redis.client import NEVER_DECODE

from common.artifacts import Artifacts
from common.keys import BATCH_PRIORITY, REQUEUE_PRIORITY, Keys, part_id
from common.schemas.checks import STORED_CONTEXT
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobList, JobStatus, JobSummary, WorkerHeartbeat
from common.settings import Settings
from common.store.calls import (
    cancel_args,
    check_cancel,
    check_created,
    check_replay,
    create_call,
    create_parts_call,
)
from common.store.clients import WRITE_PROBE_TTL_MS, async_client, async_data_client
from common.store.errors import JobNotFound
from common.store.outbox import AsyncOutbox
from common.store.parts import part_reads, summary_with_parts, with_parts
from common.store.records import (
    LIST_SCAN_MAX,
    SUMMARY_FIELDS,
    WORKER_FORGET_S,
    JobRecord,
    MediaMessageFor,
    MessageFor,
    StreamState,
    decode_log,
    heartbeats_from,
    job_text,
    oldest_of,
    oldest_page,
    record_from_hash,
    record_reads,
    summary_from_hash,
    text_read,
    with_log_tail,
    worker_keys,
)
from common.store.responses import ResponseRecords
from common.store.scripts import source
from common.store.service_times import estimate_start_s, mean_service_s, model_load
from common.store.watchers import WatcherSets
from common.tenants import tenant_of

QUEUE_POSITION_SCAN = 1000  # queued jobs read to count a job's place among its model's


class AsyncJobStore(WatcherSets, ResponseRecords):
    """The API's store, over redis.asyncio. ``broker``: the broker's Redis when it is another
    than the job data's (SPOOL_BROKER_URL), whose queue lists it reads and relays messages to."""

    def __init__(self, client: aredis.Redis, settings: Settings, broker: aredis.Redis | None = None) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = client
        self.broker = broker or client
        self.outbox = AsyncOutbox(client, broker, self.keys) if broker is not None else None
        self._create = client.register_script(source("create"))
        self._cancel = client.register_script(source("cancel"))
        self._create_parts = client.register_script(source("create_parts"))
        self.artifacts = Artifacts.at(settings.artifact_url)

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncJobStore:
        broker = async_client(settings.broker_redis_url) if settings.broker_apart else None
        return cls(async_data_client(settings.redis_url), settings, broker)

    async def close(self) -> None:
        await self.redis.aclose()
        if self.broker is not self.redis:
            await self.broker.aclose()

    async def relay(self, buckets: Iterable[int] | None = None) -> None:
        """Send the broker messages the scripts left in the outboxes (those of ``buckets``, or
        all: common/store/outbox.py); nothing to do with one Redis."""
        if self.outbox is not None:
            await self.outbox.relay_or_log(buckets)

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
        media_message_for: MediaMessageFor | None = None,
    ) -> Job:
        """Store a queued job, and with ``message_for`` its broker message in the same script.

        With an ``idempotency_key`` that this owner used before (within SPOOL_JOB_TTL_S), no job
        is created: the earlier one is returned, or IdempotencyConflict raised when it was made
        for another request. Raises QueueFull when SPOOL_MAX_QUEUED_JOBS jobs are queued,
        KeyQueueFull when the owner's SPOOL_MAX_QUEUED_JOBS_PER_KEY are.
        """
        if request.parts is not None:  # media_message_for: the message of an image part
            fields, (keys, args) = create_parts_call(
                self.keys, self.settings, request, owner, message_for, media_message_for, idempotency_key
            )
            script = self._create_parts
        else:
            fields, (keys, args) = create_call(
                self.keys, self.settings, request, owner, message_for, idempotency_key
            )
            script = self._create
        earlier = check_created(
            await script(keys, args),
            self.settings.max_queued_jobs,
            self.settings.max_queued_of(tenant_of(owner)),
        )
        if earlier is not None:
            return check_replay(await self.get_record(earlier), request)
        await self.relay([self.keys.bucket_of(fields["id"])])
        if request.parts is not None:
            return (await self.get_record(fields["id"])).job
        return record_from_hash(fields, "").job

    async def get_record(self, job_id: str) -> JobRecord:
        async with self.redis.pipeline(transaction=False) as pipe:  # see record_reads
            h, text, logged = await record_reads(pipe, self.keys, job_id).execute()
        if not h:
            raise JobNotFound(job_id)
        if "parts" in h:  # its text key is its text parts' (part_append.lua), at every append
            record = record_from_hash(h, text or "")
        elif (read := text_read(h, text, logged)) is None:
            record = record_from_hash(h, job_text(await self.read_log(job_id)))
        else:
            record = record_from_hash(h, read[0])
            if read[1]:  # a running job's events after its last checkpoint
                record = with_log_tail(record, await self.read_log(job_id, after=read[1]))
        if "parts" in h:
            async with self.redis.pipeline(transaction=False) as pipe:
                replies = await part_reads(pipe, self.keys, job_id, int(h["parts"])).execute()
            record = with_parts(record, replies[::2], replies[1::2])
        return record

    async def get_job(self, job_id: str) -> Job:
        return (await self.get_record(job_id)).job

    async def owner(self, job_id: str) -> str | None:
        """The hash of the API key that created the job (empty without keys); None: no such job."""
        owner = await self.redis.hget(self.keys.job(job_id), "owner")
        return None if owner is None else str(owner)

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
            JobRequest.model_validate_json(request, context=STORED_CONTEXT),
            float(created_at),
            model or None,
            int(length),
        )

    async def read_log(self, job_id: str, after: int = 0) -> list[LogEntry]:
        """The events with seq > after (entry i holds seq i + 1)."""
        return decode_log(await self.redis.lrange(self.keys.job_log(job_id), after, -1))

    async def part_content(self, job_id: str, index: int) -> bytes | None:
        """A finished image part's bytes (PNG); None until it succeeded, and after it expired."""
        key = self.keys.part_content(part_id(job_id, index))
        raw = await self.redis.execute_command("GET", key, **{NEVER_DECODE: True})
        if raw is None or self.artifacts is None:
            return bytes(raw) if raw is not None else None
        return await asyncio.to_thread(self.artifacts.read, bytes(raw).decode())  # its artifact's name

    async def request_cancel(self, job_id: str) -> Job:
        """Cancel a job: at once if queued, at the worker's next step if running.

        Raises JobNotFound, or Conflict if the job already finished otherwise than cancelled.
        """
        keys, args = cancel_args(self.keys, job_id, self.settings.job_ttl_s)
        check_cancel(await self._cancel(keys, args), job_id)
        return await self.get_job(job_id)

    async def queued_count(self) -> int:
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in self.keys.bucket_range():
                pipe.zcard(self.keys.queued_jobs(b))
            return sum(await pipe.execute())

    async def _oldest_queued(self, count: int) -> list[str]:
        """The jobs queued longest, oldest first, of every bucket's queued set (up to ``count``)."""
        per = oldest_page(self.keys, count)
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in self.keys.bucket_range():
                pipe.zrange(self.keys.queued_jobs(b), 0, per - 1, withscores=True)
            return oldest_of(await pipe.execute(), per, count)

    async def queue_position(self, job_id: str) -> int | None:
        """How many jobs its model's workers take before this queued one (None: not queued).

        In the queue's order: the requeues waiting first. An interactive job waits for those of
        its tenant queue queued before it (``Keys.tenant_queue``), and the tenant queues take
        turns, so for as many jobs of each other tenant queue (those queued after it too), give
        or take one each: where the turns stand is the worker's. A job of the batch tier (flex)
        waits for every interactive one, for the batch lines sent before it and the flex jobs
        queued before it. Numeric priorities, which the engine orders among the jobs it holds,
        are not counted. The jobs are read among the oldest QUEUE_POSITION_SCAN of every
        model's: past them it is a lower bound.
        """
        queued = self.keys.queued_jobs(self.keys.bucket_of(job_id))
        queue, tier, owner = await self.redis.hmget(self.keys.job(job_id), ["queue", "tier", "owner"])
        if await self.redis.zscore(queued, job_id) is None or not queue:
            return None
        queue = str(queue)
        ids = await self._oldest_queued(QUEUE_POSITION_SCAN)
        rank = ids.index(job_id) if job_id in ids else len(ids)  # past the scan: all read are ahead
        async with self.broker.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys.broker_list(queue, REQUEUE_PRIORITY))
            pipe.llen(self.keys.broker_list(queue, BATCH_PRIORITY))
            requeued, lines = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for j in ids:
                pipe.hmget(self.keys.job(str(j)), ["queue", "tier", "owner"])
            replies = await pipe.execute()
        ours = [(i, t, o) for i, (q, t, o) in enumerate(replies) if q == queue and i != rank]
        if tier:
            return int(requeued) + int(lines) + sum(1 for i, t, _ in ours if not t or i < rank)

        def tenant_queue(owner: str | None) -> str:
            return Keys.tenant_queue(queue, tenant_of(owner or ""))

        mine = tenant_queue(str(owner or ""))
        interactive = Counter(tenant_queue(o) for _, t, o in ours if not t)
        ahead = sum(1 for i, t, o in ours if not t and i < rank and tenant_queue(o) == mine)
        del interactive[mine]
        return int(requeued) + ahead + sum(min(n, ahead) for n in interactive.values())

    async def estimated_start_s(self, job_id: str, position: int) -> float | None:
        """Seconds until a queued job at ``position`` can be expected to start, from its model's
        live workers (slots, requests held) and recent service times; None without a basis
        (common/store/service_times.py)."""
        queue = await self.redis.hget(self.keys.job(job_id), "queue")
        load = model_load(await self.list_workers(), self.keys, str(queue)) if queue else None
        if load is None:
            return None
        return estimate_start_s(position, *load, await mean_service_s(self.redis, self.keys, str(queue)))

    async def list_jobs(
        self,
        owner: str,
        limit: int,
        after: str | None = None,
        status: JobStatus | None = None,
        batch_lines: bool = True,
    ) -> JobList:
        """The owner's jobs newest first, from its index (``Keys.owner_jobs``), after job ``after``
        (``batch_lines`` False: without the jobs of batches' lines).

        Reads at most LIST_SCAN_MAX index entries: with a filter that matches few of them, the page
        may be short with ``has_more`` set and ``last_id`` the last entry read. Expired jobs are skipped.
        """
        indexes = [self.keys.owner_jobs(owner, b) for b in self.keys.bucket_range()]
        starts = await self._index_starts(indexes, after)
        found: list[JobSummary] = []
        part_counts: dict[str, int] = {}  # the jobs with parts among those found: their part count
        last_read: str | None = None
        read = 0
        while len(found) <= limit and read < LIST_SCAN_MAX:
            ids = await self._index_page(indexes, starts, min(2 * limit, LIST_SCAN_MAX - read))
            if not ids:
                break
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hmget(self.keys.job(job_id), SUMMARY_FIELDS)
                rows = await pipe.execute()
            for job_id, row in zip(ids, rows, strict=True):
                h = dict(zip(SUMMARY_FIELDS, row, strict=True))
                wanted = (status is None or h["status"] == status.value) and (batch_lines or not h["batch"])
                if h["id"] is not None and wanted:
                    found.append(summary_from_hash(h))
                    if h.get("parts"):
                        part_counts[job_id] = int(str(h["parts"]))
                    if len(found) > limit:
                        break
                last_read = job_id
            read += len(ids)
        has_more = len(found) > limit or (read >= LIST_SCAN_MAX and last_read is not None)
        data = await self._listed_parts(found[:limit], part_counts)
        last_id = last_read if has_more and len(found) <= limit else (data[-1].id if data else None)
        return JobList(data=data, first_id=data[0].id if data else None, last_id=last_id, has_more=has_more)

    async def _index_starts(self, indexes: list[str], after: str | None) -> list[int]:
        """Where to read each bucket's index of an owner's jobs from (newest first): past job
        ``after`` in the order of the whole index, (created_at, id) descending, or from the start.
        Raises JobNotFound when ``after`` is not in the owner's index (another's job, or expired)."""
        if after is None:
            return [0] * len(indexes)
        score = await self.redis.zscore(indexes[self.keys.bucket_of(after)], after)
        if score is None:
            raise JobNotFound(after)
        async with self.redis.pipeline(transaction=False) as pipe:
            for index in indexes:
                pipe.zcount(index, f"({score!r}", "+inf")
                pipe.zrangebyscore(index, score, score)
            replies = await pipe.execute()
        # Before it: a later created_at, or the same and an id not below its own (ZREVRANGE's order).
        return [
            int(n) + sum(str(m) >= after for m in same)
            for n, same in zip(replies[::2], replies[1::2], strict=True)
        ]

    async def _index_page(self, indexes: list[str], starts: list[int], count: int) -> list[str]:
        """The next ``count`` ids of an owner's index, newest first, merged from its buckets' from
        ``starts`` (moved past those returned)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for index, start in zip(indexes, starts, strict=True):
                pipe.zrevrange(index, start, start + count - 1, withscores=True)
            pages = await pipe.execute()
        entries = sorted(
            ((score, str(j), b) for b, page in enumerate(pages) for j, score in page), reverse=True
        )
        for _, _, b in entries[:count]:
            starts[b] += 1
        return [j for _, j, _ in entries[:count]]

    async def _listed_parts(self, jobs: list[JobSummary], part_counts: dict[str, int]) -> list[JobSummary]:
        """The listed jobs with their parts (one more round trip when any has parts)."""
        with_parts = [j.id for j in jobs if j.id in part_counts]
        if not with_parts:
            return jobs
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in with_parts:
                for k in range(part_counts[job_id]):
                    pipe.hgetall(self.keys.job(part_id(job_id, k)))
            replies = iter(await pipe.execute())
        hashes = {job_id: [next(replies) for _ in range(part_counts[job_id])] for job_id in with_parts}
        return [summary_with_parts(j, hashes[j.id]) if j.id in hashes else j for j in jobs]

    async def queue_depths(self, models: Iterable[str]) -> list[tuple[str, int]]:
        """Messages waiting in the text queues of these models together ("llm") and in the media
        queue ("media"), every priority's list counted."""
        queues = {
            "llm": [self.keys.model_queue(m) for m in sorted(set(models))],
            "media": [self.keys.queue_media],
        }
        lists = {kind: [name for q in qs for name in self.keys.queue_lists(q)] for kind, qs in queues.items()}
        async with self.broker.pipeline(transaction=False) as pipe:
            for names in lists.values():
                for name in names:
                    pipe.llen(name)
            lengths = iter(await pipe.execute())
        return [(kind, sum(next(lengths) for _ in names)) for kind, names in lists.items()]

    async def get_tokenizer(self, digest: str) -> str | None:
        """The tokenizer spec a heartbeat names (common/prompt_tokens.py), None if not stored."""
        spec = await self.redis.get(self.keys.tokenizer(digest))
        return None if spec is None else str(spec)  # (decode_responses: a str already)

    async def queued_for(self, job_id: str) -> tuple[str, str | None]:
        """A job's queue (its hash's ``queue``; '' for none) and the model its request named (None)."""
        queue, request = await self.redis.hmget(self.keys.job(job_id), ["queue", "request"])
        return str(queue or ""), (json.loads(request).get("model") if request else None)

    async def served_stamps(self) -> dict[str, float]:
        """Each text model served within ``WORKER_FORGET_S`` -> its last heartbeat's time."""
        stamps: list[Any] = await self.redis.zrangebyscore(
            self.keys.served_models(), time.time() - WORKER_FORGET_S, "+inf", withscores=True
        )
        return {str(m): float(t) for m, t in stamps}

    async def recent_models(self) -> list[str]:
        """The text models a worker served within ``WORKER_FORGET_S``, live or not."""
        since = time.time() - WORKER_FORGET_S
        return [str(m) for m in await self.redis.zrangebyscore(self.keys.served_models(), since, "+inf")]

    async def list_workers(self) -> list[WorkerHeartbeat]:
        names = [str(n) for n in await self.redis.zrange(self.keys.workers(), 0, -1)]
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:  # (no MGET: the keys span slots)
            for key in worker_keys(self.keys, names):
                pipe.get(key)
            return heartbeats_from(await pipe.execute())
