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

import asyncio
import json
import secrets
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from common.artifacts import Artifacts, results_name
from common.keys import Keys
from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store.files import FenceLost, FileRecords, flat, hash_or_none
from common.store.outbox import AsyncOutbox
from common.store.records import OWNER_INDEX_MAX, QueueMessage, new_job_fields, owner_index_age_s
from common.store.scripts import source

ENDED = ("completed", "failed", "expired", "cancelled")  # a batch's final statuses
# With SPOOL_ARTIFACT_URL, a running batch's results leave Redis this many lines at a time (spill).
SPILL_LINES = 1000


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
    "file_reserve",
    "file_append_attempt",
    "feeder_claim",
    "batch_validated",
    "batch_feed",
    "batch_record",
    "batch_spill",
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

    async def spill(self, batch_id: str, start: int, fence: str) -> bool:
        """Move the results of lines ``start`` to ``start + SPILL_LINES - 1``, every one ended,
        out of Redis into an artifact (SPOOL_ARTIFACT_URL), so that a running batch keeps in Redis
        only the results of its lines past the last whole page that ended. Under the feeder's
        fence, the next page only (batch_spill.lua); False if not moved (the fence lost, or moved
        by another feeder first), its artifact then deleted. The artifact is indexed with the
        files' TTL, so a batch that never ends leaves nothing behind."""
        assert self.artifacts is not None
        k, bucket = self.keys, self.keys.bucket_of(batch_id)
        raw = await self.redis.hmget(
            k.batch_results(batch_id), [str(i) for i in range(start, start + SPILL_LINES)]
        )
        name = results_name(batch_id, start, secrets.token_hex(4))
        await self.redis.zadd(k.artifacts(bucket), {name: time.time() + self.settings.file_ttl_s})
        page = "".join((str(r) if r else "") + "\n" for r in raw).encode()  # a blank line: none
        await asyncio.to_thread(self.artifacts.write, name, page)
        keys = [k.batch(batch_id), k.batch_results(batch_id), k.batch_feeder(bucket)]
        if int(await self._scripts["batch_spill"](keys, [fence, start, SPILL_LINES, name])):
            return True
        await self._drop_artifacts([name], bucket)
        return False

    async def results(self, batch_id: str, lines: Sequence[int]) -> list[LineResult | None]:
        """The recorded results of these lines (None: a blank line, or none yet), read from the
        artifacts of the pages spilled and the results hash."""
        if not lines:
            return []
        raw: dict[int, str] = {}
        spilled = 0  # (none without artifacts: no read)
        if self.artifacts is not None:
            spilled = int(await self.redis.hget(self.keys.batch(batch_id), "spilled") or 0)
        for start in sorted({i - i % SPILL_LINES for i in lines if i < spilled}):
            raw |= await self._spilled(batch_id, start)
        if rest := [i for i in lines if i >= spilled]:
            hashed = await self.redis.hmget(self.keys.batch_results(batch_id), [str(i) for i in rest])
            raw |= {i: str(r) for i, r in zip(rest, hashed, strict=True) if r}
        return [LineResult(i, *json.loads(r)) if (r := raw.get(i)) else None for i in lines]

    async def _spilled(self, batch_id: str, start: int) -> dict[int, str]:
        """A spilled page's results by line (none if its artifact is gone: the batch ended)."""
        name = await self.redis.hget(self.keys.batch(batch_id), f"spilled_at:{start}")
        data = await asyncio.to_thread(self.artifacts.read, str(name)) if self.artifacts and name else None
        if data is None:
            return {}
        return {i: r for i, r in enumerate(data.decode().split("\n")[:SPILL_LINES], start) if r}

    async def _drop_spilled(self, batch_id: str) -> None:
        """Delete the artifacts of the batch's spilled pages (its files hold their lines now)."""
        k = self.keys
        spilled = int(await self.redis.hget(k.batch(batch_id), "spilled") or 0)
        if spilled:
            fields = [f"spilled_at:{s}" for s in range(0, spilled, SPILL_LINES)]
            names = [str(n) for n in await self.redis.hmget(k.batch(batch_id), fields) if n]
            await self._drop_artifacts(names, k.bucket_of(batch_id))
            await self.redis.hdel(k.batch(batch_id), "spilled", *fields)

    async def _drop_artifacts(self, names: Sequence[str], bucket: int) -> None:
        assert self.artifacts is not None
        for name in names:
            await asyncio.to_thread(self.artifacts.delete, name)
        if names:
            await self.redis.zrem(self.keys.artifacts(bucket), *names)

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
            await self._drop_spilled(batch_id)
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
