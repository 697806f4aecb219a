"""Who watches which job, across API processes, and the cancel of abandoned foreground jobs.

Every stream (or non-streamed wait) on a job holds a token in the job's watcher set in Redis,
scored with a lease deadline that its API process renews. A watcher that leaves is replaced by
a ghost that counts for ``SPOOL_DETACH_GRACE_S`` more, and a check runs once it is gone: if the
job is still queued or running, was not submitted with ``background: true`` and nobody watches
it, it is cancelled, which frees its engine slot at the worker's next step. So a job is
cancelled only after a whole grace period without a watcher, whichever process's check sees it.

A process that stops turns its watchers into ghosts and its checks die with it; a process that
dies leaves tokens that lapse on their own, and count for the grace after that (so its clients
get the grace to resume elsewhere). For both, the worker that runs the job is the one left to
check: it cancels a foreground job nobody has watched for the grace (workers/liveness.py). Both
sides count with ``common.store.watching``; the store writes the sets (common/store/watchers.py).

The key and its clock:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix
(``{p}:job:{id}:watchers``) and docs/internals.md#job-lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from redis.exceptions import RedisError

from common.asyncio_tasks import cancel_until_done
from common.store import AsyncJobStore, StoreError

log = logging.getLogger(__name__)

LEASE_S = 15.0  # a watcher token lapses this long after its process stopped renewing it
RENEW_S = LEASE_S / 3


class Watchers:
    def __init__(self, store: AsyncJobStore, grace_s: float) -> None:
        self._store = store
        self._grace_s = grace_s
        # The expiry each write sets again: as long as a job's, and past any member's counting (a
        # lease and then the grace). A ghost that replaces the last watcher makes a new key,
        # without the old one's expiry.
        self._ttl_s = max(store.settings.job_ttl_s, math.ceil(LEASE_S + grace_s) + 1)
        self._mine: dict[str, str] = {}  # token -> job id: this process's live watchers
        self._leaving: dict[str, str] = {}  # token -> job id: left, its ghost not yet written
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._spawn(self._renew_forever())

    async def stop(self) -> None:
        """Stop renewing and checking; every watcher of this process becomes a ghost, so its job
        gets a whole grace from now and is then the worker's to cancel (nobody here checks)."""
        await cancel_until_done(self._tasks)
        watchers = {**self._mine, **self._leaving}
        if not watchers:
            return
        try:
            await self._store.ghost_watchers(watchers, self._grace_s, self._ttl_s)
        except RedisError as e:
            log.warning("could not leave %d watchers (%s); their leases lapse instead", len(watchers), e)

    @contextlib.asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[None]:
        """Count as a watcher of the job while inside."""
        token = uuid.uuid4().hex
        self._mine[token] = job_id
        await self._store.add_watcher(job_id, token, LEASE_S, self._ttl_s)
        try:
            yield
        finally:
            # NOTE: no await here: a stream's client that hung up cancels the task this runs in,
            # and any await would be cancelled again; the leaving happens in a task of its own.
            self._leaving[token] = self._mine.pop(token)
            self._spawn(self._leave(job_id, token))

    def check_later(self, job_id: str) -> None:
        """Decide after the grace period whether the job lost all its watchers."""
        self._spawn(self._check(job_id, None))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _leave(self, job_id: str, token: str) -> None:
        until = None
        try:
            until = await self._store.ghost_watchers({token: job_id}, self._grace_s, self._ttl_s)
        except RedisError as e:
            log.warning("could not remove watcher of job %s (%s); its lease lapses instead", job_id, e)
        self._leaving.pop(token, None)
        await self._check(job_id, until)

    async def _check(self, job_id: str, until: float | None) -> None:
        """After the grace period, cancel the job if nobody watches it; ``until``: the end of the
        leaver's ghost on Redis's clock (the check counts at that time at the earliest)."""
        # NOTE: a loop, as uvloop's timers can fire early (it reads its clock once per loop
        # iteration, in whole milliseconds). A check run early counted the leaver's own ghost,
        # kept the job, and never looked again; ``until`` guards the same on Redis's side.
        end = time.monotonic() + self._grace_s
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(left)
        try:
            watched = await self._store.watched(job_id, self._grace_s, until)
            if watched or not (await self._store.stream_state(job_id)).foreground_and_live:
                return
            await self._store.request_cancel(job_id)
            log.info("cancelled job %s: its client left and nobody resumed it", job_id)
        except StoreError:
            pass  # it finished (or expired) meanwhile
        except RedisError as e:
            log.warning("could not check job %s for detached streams: %s", job_id, e)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            mine = list(self._mine.items())
            if not mine:
                continue
            try:
                await self._store.renew_watchers(mine, LEASE_S, self._ttl_s)
            except RedisError as e:
                log.warning("could not renew stream watchers: %s", e)
