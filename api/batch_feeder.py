"""The batch feeder: it validates new batches, turns their lines into jobs a bounded window at a
time, records each ended job's result line, and assembles the output and error files.

Every API process runs one as a task of its lifespan, and only the holder of a lease in Redis
works. So a batch goes on when the process that created it dies. Every write is a script that
is safe to run twice, and the files and the batch's end are fenced by the lease. The steps and
their scripts are in docs/internals.md#batches-apibatch_feederpy.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from redis.exceptions import RedisError

from api.batch_files import PAGE_LINES, ResultFiles
from api.batch_lines import (
    LineError,
    batch_error,
    crashed,
    job_result,
    line_request,
    lost_result,
    needs_view_log,
    parse_line,
    refused,
)
from api.context_length import ContextCheck
from api.enqueue import Enqueuer
from api.errors import ApiError
from api.served import ServedModels, queue_model, served_name
from common.asyncio_tasks import cancel_until_done
from common.keys import BATCH_PRIORITY, Keys
from common.schemas.views import JobStatus
from common.settings import Settings
from common.store import (
    SPILL_LINES,
    AsyncBatchStore,
    AsyncJobStore,
    Conflict,
    FenceLost,
    JobNotFound,
    LineJob,
    LineResult,
    new_job_id,
)

log = logging.getLogger(__name__)

LEASE_TICKS = 25  # the feeder's lease lasts this many ticks: another process takes over after it
CLAIM_TICKS = 5  # the leases are taken or renewed every this many ticks (one script per bucket)
MAX_ERRORS = 100  # a failed batch's errors.data names at most this many lines
CONCURRENT = 8  # batches advanced at once
MAX_STRIKES = 3  # ticks in a row a batch may fail with an unexpected error before it fails


class BatchFeeder:
    def __init__(
        self,
        settings: Settings,
        jobs: AsyncJobStore,
        batches: AsyncBatchStore,
        enqueuer: Enqueuer,
        served: ServedModels,
        context: ContextCheck,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.batches = batches
        self.enqueuer = enqueuer
        self.served = served
        self.context = context
        self.files = ResultFiles(settings, batches)
        self._token = secrets.token_hex(8)
        self._lease_s = settings.batch_feed_s * LEASE_TICKS
        self._fences: dict[int, str] = {}  # bucket -> token:fence, of the leases this process holds
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(CONCURRENT)
        self._strikes: dict[str, int] = {}

    async def run(self) -> None:
        ticks = 0
        try:
            while True:
                try:
                    if ticks % CLAIM_TICKS == 0:
                        await self.claim()
                    ticks += 1
                    if self._fences:
                        await self.tick()
                        await self.batches.sweep_artifacts(self._fences)
                except RedisError as e:
                    log.warning("batch feeder: Redis unreachable (%s)", e)
                except Exception:
                    log.exception("batch feeder tick failed")
                await asyncio.sleep(self.settings.batch_feed_s)
        finally:
            await cancel_until_done(self._tasks.values())

    async def claim(self) -> None:
        """Take or renew the lease of each bucket's batches (one bucket on a standalone Redis:
        common/keys.py); another process may hold some."""
        for bucket in self.settings.keys.bucket_range():
            fence = await self.batches.claim_feeder(self._token, self._lease_s, bucket)
            if fence:
                self._fences[bucket] = fence
            else:
                self._fences.pop(bucket, None)

    async def tick(self) -> None:
        """Start a step for each active batch of the buckets held whose last step ended."""
        self._tasks = {b: t for b, t in self._tasks.items() if not t.done()}
        for batch_id in await self.batches.active_batches(self._fences):
            if batch_id not in self._tasks:
                fence = self._fences[self.settings.keys.bucket_of(batch_id)]
                self._tasks[batch_id] = asyncio.create_task(self._step(batch_id, fence))

    async def _step(self, batch_id: str, fence: str) -> None:
        """One batch's step, whatever it raises kept to this batch."""
        async with self._slots:
            try:
                await self.advance(batch_id, fence)
            except FenceLost:
                log.warning("batch %s: the feeder's lease was taken over; its step stopped", batch_id)
            except RedisError as e:
                log.warning("batch %s: Redis unreachable (%s)", batch_id, e)
            except Exception as e:
                await self._strike(batch_id, e)
            else:
                self._strikes.pop(batch_id, None)

    async def _strike(self, batch_id: str, e: Exception) -> None:
        strikes = self._strikes[batch_id] = self._strikes.get(batch_id, 0) + 1
        log.exception("batch %s: step failed (%d of %d)", batch_id, strikes, MAX_STRIKES)
        if strikes < MAX_STRIKES:
            return
        del self._strikes[batch_id]
        error = batch_error(
            "internal_error", f"the batch could not be advanced: {type(e).__name__}: {str(e)[:200]}"
        )
        await self.batches.fail_batch(batch_id, [error])

    async def advance(self, batch_id: str, fence: str) -> None:
        b = await self.batches.get_batch(batch_id)
        if b is None or b["status"] in ("completed", "failed", "expired", "cancelled"):
            await self.batches.forget_active(batch_id)
            return
        if b["status"] == "validating":
            await self.validate(b)
            return
        if "line_count" not in b:  # cancelled while it was validated: nothing ran
            await self.batches.finish(batch_id, fence, "", "", 0, 0)
            return
        ending = b.get("ending", "")
        if not ending and time.time() >= float(b["expires_at"]):
            await self.batches.end_batch(batch_id, "expired")
            ending = "expired"
        window = await self.collect(b, ending)
        await self.spill(b, window, fence)
        if ending:
            if window:
                await self.cancel(window)
            else:
                await self.files.assemble(b, ending, fence)
        elif b["status"] == "finalizing":
            await self.files.assemble(b, "", fence)
        elif int(b["next_line"]) < int(b["line_count"]):
            await self.feed(b, self.settings.batch_window - len(window))
        elif not window and await self.batches.finalizing(batch_id):
            await self.files.assemble(b, "", fence)

    # -- validating -------------------------------------------------------------------------------

    async def validate(self, b: dict[str, str]) -> None:
        batch_id, endpoint = b["id"], b["endpoint"]
        meta = await self.batches.get_file(b["input_file_id"])
        if meta is None:
            error = batch_error("file_not_found", "the input file is gone", "input_file_id")
            await self.batches.validated(batch_id, False, 0, 0, [error])
            return
        line_count = int(meta["lines"])
        seen: set[str] = set()
        errors: list[dict[str, Any]] = []
        for start in range(0, line_count, PAGE_LINES):
            for i, raw in enumerate(await self.batches.read_lines(meta["id"], start, PAGE_LINES), start + 1):
                try:
                    line = parse_line(raw, endpoint)
                    if line is not None and line["custom_id"] in seen:
                        raise LineError(
                            "duplicate_custom_id",
                            f"custom_id {line['custom_id']!r} is not unique",
                            "custom_id",
                        )
                except LineError as e:
                    errors.append(e.entry(i))
                except Exception as e:  # whatever else a line raises fails the batch, naming it
                    errors.append(LineError("invalid_line", f"{type(e).__name__}: {str(e)[:200]}").entry(i))
                else:
                    if line is not None:
                        seen.add(line["custom_id"])
            await asyncio.sleep(0)  # let the process's requests through between pages
        if not seen and not errors:
            errors.append(batch_error("empty_file", "the input file holds no request line"))
        await self.batches.validated(batch_id, not errors, line_count, len(seen), errors[:MAX_ERRORS])

    # -- running ----------------------------------------------------------------------------------

    async def collect(self, b: dict[str, str], ending: str) -> dict[str, tuple[int, str]]:
        """Record the results of the window's jobs that ended; returns the rest of the window."""
        window = await self.batches.window(b["id"])
        ids = list(window)
        statuses = await self.batches.job_statuses(ids)
        ended = [j for j, s in zip(ids, statuses, strict=True) if s is None or JobStatus(s).terminal]
        await self._resend_lost(
            [j for j, s in zip(ids, statuses, strict=True) if s == JobStatus.QUEUED.value]
        )
        if not ended:
            return window
        served = await self.served.get()
        model = min(served, default="")
        results = []
        for job_id in ended:
            line, custom_id = window.pop(job_id)
            try:
                record = await self.jobs.get_record(job_id)
            except JobNotFound:
                results.append(lost_result(line, custom_id, job_id))
            else:
                log = await self.jobs.read_log(job_id) if needs_view_log(b["endpoint"], record) else []
                try:
                    worker = served.get(record.job.model or model)
                    parser = worker.tool_parser if worker is not None else None
                    results.append(
                        job_result(line, custom_id, b["endpoint"], record, model, ending, log, parser)
                    )
                except Exception as e:
                    results.append(crashed(line, custom_id, e, job_id))
        await self.batches.record(b["id"], results)
        return window

    async def spill(self, b: dict[str, str], window: dict[str, tuple[int, str]], fence: str) -> None:
        """With the results' bytes out of Redis (SPOOL_ARTIFACT_URL), move each page of lines that
        all ended (below the first line still in the window, or not fed yet) to an artifact."""
        if self.batches.artifacts is None:
            return
        ended = min((line for line, _ in window.values()), default=int(b["next_line"]))
        for start in range(int(b.get("spilled", 0)), ended - SPILL_LINES + 1, SPILL_LINES):
            if not await self.batches.spill(b["id"], start, fence):
                return  # another feeder's, or the lease lost

    async def _resend_lost(self, queued: list[str]) -> None:
        """Send again the messages of lines queued for a lease although the batch's queue list is
        empty (workers/reaper.py does the same for interactive jobs)."""
        if not queued:
            return
        queues = dict(zip(queued, await self.batches.job_queues(queued), strict=True))
        empty = {
            q
            for q in set(queues.values())
            if not await self.batches.queue_length(Keys.broker_list(q, BATCH_PRIORITY))
        }
        for job_id, queue in queues.items():
            if queue in empty and await self.batches.resend(
                job_id, self.enqueuer.generate(job_id, queue, BATCH_PRIORITY), self.settings.lease_s
            ):
                log.warning("batch line %s lost its message; sent it again", job_id)

    async def feed(self, b: dict[str, str], room: int) -> None:
        if room <= 0:
            return
        batch_id, start = b["id"], int(b["next_line"])
        raws = await self.batches.read_lines(
            b["input_file_id"], start, min(room, int(b["line_count"]) - start)
        )
        if not raws:  # the input file was deleted or expired: the rest of its lines cannot run
            await self.batches.end_batch(batch_id, "cancelled")
            return
        models = await self.served.get()
        # The model of a line that names none: one that generates, or one that embeds.
        defaults = {embed: await queue_model(self.jobs, models, None, embed) for embed in (False, True)}
        jobs: list[LineJob] = []
        rejected: list[LineResult] = []
        for i, raw in enumerate(raws, start):
            line = parse_line(raw, b["endpoint"])  # validated already
            if line is None:
                continue
            job_id = new_job_id(self.settings.keys, self.settings.keys.bucket_of(batch_id))
            try:
                request = await line_request(
                    b["endpoint"], line["body"], self.settings, models, self.context, b.get("owner", "")
                )
            except ApiError as e:
                rejected.append(refused(i, line["custom_id"], e, job_id))
                continue
            except RedisError:
                raise
            except Exception as e:  # a bug or a limit missed: this line fails, the batch goes on
                rejected.append(crashed(i, line["custom_id"], e, job_id))
                continue
            named = line["body"].get("model")
            model = served_name(models, named) if named else defaults[request.embed is not None]
            message = self.enqueuer.generate(job_id, self.settings.keys.model_queue(model), BATCH_PRIORITY)
            jobs.append(LineJob(job_id, i, line["custom_id"], request, message))
        fed = await self.batches.feed(batch_id, b["owner"], (start, start + len(raws)), jobs, rejected)
        if fed != 1:
            log.info(
                "batch %s: lines from %d were fed by another feeder or it stopped (%d)", batch_id, start, fed
            )

    async def cancel(self, window: dict[str, tuple[int, str]]) -> None:
        for job_id in window:
            try:
                await self.jobs.request_cancel(job_id)  # queued: at once; running: at its next step
            except (Conflict, JobNotFound):
                pass  # it ended meanwhile: the next tick records it
