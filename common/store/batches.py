"""The API's store of batches (OpenAI's Batches API), over ``redis.asyncio``; its files' part is
common/store/files.py.

A batch is a hash (status, timestamps, counts, the next line to feed), its window (the lines
queued or running now, as jobs) and its results (one per line, set once). Every transition is one
script (common/store/lua/batch_*.lua), safe to run twice: the feeder (api/batch_feeder.py) may be
taken over mid-tick by another API process. A batch's result files and its end are written under
the feeder's fence (feeder_claim.lua says how). Each owner (API key) has its own index of
batches, so a listing reads only that owner's objects.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from common.artifacts import Artifacts
from common.keys import Keys
from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store.files import FenceLost, FileRecords, flat, hash_or_none
from common.store.outbox import AsyncOutbox
from common.store.records import OWNER_INDEX_MAX, QueueMessage, new_job_fields, owner_index_age_s
from common.store.scripts import source

ENDED = ("completed", "failed", "expired", "cancelled")  # a batch's final statuses


@dataclass(frozen=True)
class LineJob:
    """A batch line that becomes a job."""

    job_id: str
    line: int
    custom_id: str
    request: JobRequest
    message: QueueMessage


@dataclass(frozen=True)
class LineResult:
    """A line's result, its output or error line. ``kind`` is completed or failed."""

    line: int
    kind: str
    result: dict[str, Any]
    job_id: str = ""  # the job that leaves the window with it; empty for a line that never ran


BATCH_LINE_STATES = ("pending", "in_flight", "completed", "failed")


@dataclass(frozen=True)
class BatchCounts:
    """The stored batches by status, and the lines of those not ended yet by state
    (BATCH_LINE_STATES: not fed yet, queued or running as jobs, with their result)."""

    statuses: dict[str, int]
    lines: dict[str, int]


_SCRIPTS = (
    "file_commit",
    "file_usage",
    "file_append_attempt",
    "feeder_claim",
    "batch_validated",
    "batch_feed",
    "batch_record",
    "batch_end",
    "batch_finalizing",
    "batch_finish",
    "batch_fail",
    "batch_resend",
    "batch_counts",
)


class AsyncBatchStore(FileRecords):
    def __init__(self, client: aredis.Redis, settings: Settings, broker: aredis.Redis | None = None) -> None:
        self.settings = settings
        self.keys: Keys = settings.keys
        self.redis = client
        # As AsyncJobStore's: the broker's Redis when apart, and the outbox its lines' messages wait in.
        self.broker = broker or client
        self.outbox = AsyncOutbox(client, broker, self.keys) if broker is not None else None
        self._scripts = {name: client.register_script(source(name)) for name in _SCRIPTS}
        self.artifacts = Artifacts.at(settings.artifact_url)

    # -- batches ----------------------------------------------------------------------------------

    async def create_batch(self, fields: dict[str, str]) -> None:
        """Store a new batch; its id is in its owner's bucket (``Keys.owner_bucket``), as its
        files are, so its indexes are written in one transaction."""
        batch_id, k = fields["id"], self.keys
        bucket = k.bucket_of(batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(k.batch(batch_id), mapping=fields)  # type: ignore[arg-type]  # redis-py's Mapping is invariant
            pipe.zadd(k.batches(bucket), {batch_id: float(fields["created_at"])})
            pipe.zadd(k.owner_batches(fields["owner"]), {batch_id: float(fields["created_at"])})
            pipe.sadd(k.active_batches(bucket), batch_id)
            await pipe.execute()

    async def get_batch(self, batch_id: str) -> dict[str, str] | None:
        return hash_or_none(await self.redis.hgetall(self.keys.batch(batch_id)))

    async def list_batches(self, owner: str) -> list[dict[str, str]]:
        """The owner's batches, newest first; forgets the ids of batches that expired."""
        return await self._listed(self.keys.owner_batches(owner), self.keys.batch)

    async def batch_counts(self, live: Collection[str]) -> BatchCounts:
        """For /metrics: the batches by status, and the lines of those whose status is in
        ``live`` by state. Two round trips whatever the number of batches: the index, then one
        script that counts (batch_counts.lua) and drops the ids of batches that expired, per bucket."""
        statuses: Counter[str] = Counter()
        lines: Counter[str] = Counter(dict.fromkeys(BATCH_LINE_STATES, 0))
        for b in self.keys.bucket_range():
            index = self.keys.batches(b)
            ids = [str(i) for i in await self.redis.zrange(index, 0, -1)]
            if not ids:
                continue
            keys = [k for i in ids for k in (self.keys.batch(i), self.keys.batch_window(i))]
            reply = [str(x) for x in await self._scripts["batch_counts"]([index, *keys], [*live, "", *ids])]
            cut = reply.index("")
            statuses.update({reply[i]: int(reply[i + 1]) for i in range(0, cut, 2)})
            lines.update(dict(zip(BATCH_LINE_STATES, map(int, reply[cut + 1 :]), strict=True)))
        return BatchCounts(dict(statuses), dict(lines))

    async def end_batch(self, batch_id: str, ending: str) -> str:
        """Stop feeding a batch (``ending``: cancelled or expired); returns the status it had."""
        return str(await self._scripts["batch_end"]([self.keys.batch(batch_id)], [repr(time.time()), ending]))

    async def active_batches(self, buckets: Collection[int]) -> list[str]:
        """The active batches of these buckets, in one round trip (one per master on a cluster)."""
        pipe = self.redis.pipeline(transaction=False)
        for bucket in buckets:
            pipe.smembers(self.keys.active_batches(bucket))
        return sorted(str(b) for members in await pipe.execute() for b in members)

    async def forget_active(self, batch_id: str) -> None:
        await self.redis.srem(self.keys.active_batches(self.keys.bucket_of(batch_id)), batch_id)

    async def claim_feeder(self, token: str, lease_s: float, bucket: int) -> str:
        """Take or renew the feeder's lease of a bucket's batches: the fence it is held with
        (``token:fence``), or "" while another process holds it."""
        keys = [self.keys.batch_feeder(bucket), self.keys.batch_feeder_fence(bucket)]
        fence = int(await self._scripts["feeder_claim"](keys, [token, int(lease_s * 1000)]))
        return f"{token}:{fence}" if fence else ""

    async def validated(
        self, batch_id: str, ok: bool, line_count: int, total: int, errors: list[dict[str, Any]]
    ) -> str:
        keys = [self.keys.batch(batch_id), self.keys.active_batches(self.keys.bucket_of(batch_id))]
        args = [batch_id, "ok" if ok else "failed", repr(time.time()), line_count, total]
        return str(
            await self._scripts["batch_validated"](
                keys, [*args, json.dumps({"object": "list", "data": errors})]
            )
        )

    async def window(self, batch_id: str) -> dict[str, tuple[int, str]]:
        """The batch's jobs queued or running: job id -> (line index, custom_id)."""
        raw = await self.redis.hgetall(self.keys.batch_window(batch_id))
        return {job_id: tuple(json.loads(v)) for job_id, v in raw.items()}  # type: ignore[misc]

    async def job_statuses(self, job_ids: Sequence[str]) -> list[str | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), "status")
            return list(await pipe.execute())

    async def feed(
        self,
        batch_id: str,
        owner: str,
        lines: tuple[int, int],
        jobs: Sequence[LineJob],
        rejected: Sequence[LineResult],
    ) -> int:
        """Turn lines ``lines[0]`` to ``lines[1] - 1`` into jobs, or results where refused.

        Returns 1 (fed), 0 (another feeder fed them first) or -1 (the batch is not running)."""
        k, now = self.keys, time.time()
        keys = [
            k.batch(batch_id),
            k.batch_window(batch_id),
            k.batch_results(batch_id),
            k.owner_jobs(owner, k.bucket_of(batch_id)),
        ]
        index = [owner_index_age_s(self.settings), OWNER_INDEX_MAX]
        args: list[Any] = [str(lines[0]), str(lines[1]), len(jobs), len(rejected), repr(now), *index]
        for j in jobs:
            fields = {**new_job_fields(j.job_id, j.request, owner, now), "batch": batch_id}
            fields["queue"] = j.message.queue
            keys += [k.job(j.job_id), j.message.list_key]
            args += [j.job_id, json.dumps([j.line, j.custom_id]), j.message.payload, 2 * len(fields)]
            args += flat(fields)
        for r in rejected:
            args += [r.line, json.dumps([r.kind, r.result])]
        fed = int(await self._scripts["batch_feed"](keys, args))
        await self._relay(batch_id)
        return fed

    async def _relay(self, object_id: str) -> None:
        """Relay the outbox of this batch's or job's bucket."""
        if self.outbox is not None:
            await self.outbox.relay_or_log([self.keys.bucket_of(object_id)])

    async def queue_length(self, broker_list: str) -> int:
        return int(await self.broker.llen(broker_list))

    async def job_queues(self, job_ids: Sequence[str]) -> list[str]:
        """The Celery queue of each of these jobs (its hash's ``queue``; empty if none)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "queue")
        return [q or "" for q in await pipe.execute()]

    async def resend(self, job_id: str, message: QueueMessage, min_gap_s: float) -> bool:
        """Push a queued line's message again if it has waited ``min_gap_s`` since it was sent."""
        keys = [self.keys.job(job_id), message.list_key]
        sent = bool(
            await self._scripts["batch_resend"](keys, [repr(time.time()), repr(min_gap_s), message.payload])
        )
        await self._relay(job_id)
        return sent

    async def record(self, batch_id: str, results: Sequence[LineResult]) -> None:
        """Set each line's result once and count it; its job leaves the window."""
        if not results:
            return
        k = self.keys
        args: list[Any] = []
        for r in results:
            args += [r.job_id, r.line, r.kind, json.dumps([r.kind, r.result])]
        await self._scripts["batch_record"](
            [k.batch(batch_id), k.batch_window(batch_id), k.batch_results(batch_id)], args
        )

    async def results(self, batch_id: str, lines: Sequence[int]) -> list[LineResult | None]:
        """The recorded results of these lines (None: a blank line, or none yet)."""
        if not lines:
            return []
        raw = await self.redis.hmget(self.keys.batch_results(batch_id), [str(i) for i in lines])
        return [LineResult(i, *json.loads(r)) if r else None for i, r in zip(lines, raw, strict=True)]

    async def finalizing(self, batch_id: str) -> bool:
        return bool(await self._scripts["batch_finalizing"]([self.keys.batch(batch_id)], [repr(time.time())]))

    async def finish(
        self, batch_id: str, fence: str, output_file_id: str, error_file_id: str, completed: int, failed: int
    ) -> str:
        """End a batch whose files are written, if ``fence`` still holds (FenceLost if not)."""
        k, bucket = self.keys, self.keys.bucket_of(batch_id)
        keys = [
            k.batch(batch_id),
            k.active_batches(bucket),
            k.batch_window(batch_id),
            k.batch_results(batch_id),
        ]
        args: list[str | int] = [
            batch_id,
            repr(time.time()),
            self.settings.file_ttl_s,
            output_file_id,
            error_file_id,
            completed,
            failed,
            fence,
        ]
        status = str(await self._scripts["batch_finish"]([*keys, k.batch_feeder(bucket)], args))
        if status == "fenced":
            raise FenceLost(fence)
        if self.artifacts is not None:
            # The result files are artifacts now, and the results are read only to write them:
            # Redis keeps no copy of the lines (a stale feeder's assembly then writes nothing).
            await self.redis.delete(k.batch_results(batch_id))
        return status

    async def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> str:
        """Fail a batch the feeder cannot advance, with the reason; returns the status it had."""
        k = self.keys
        keys = [k.batch(batch_id), k.active_batches(k.bucket_of(batch_id)), k.batch_window(batch_id)]
        keys.append(k.batch_results(batch_id))
        args: list[str | int] = [batch_id, repr(time.time()), self.settings.file_ttl_s]
        return str(
            await self._scripts["batch_fail"](keys, [*args, json.dumps({"object": "list", "data": errors})])
        )
