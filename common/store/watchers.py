"""Who watches a foreground job: its watcher set (``Keys.job_watchers``), across API processes.

Each stream or wait on a foreground job holds a token in the set, scored with a lease deadline
that its API process renews; one that leaves is replaced by a ghost scored with the end of its
grace (api/watchers.py says why). Every write sets the set's expiry again, so the set goes once
nobody wrote to it for that long. The API writes the sets (``WatcherSets``, a part of
``AsyncJobStore``); a worker reads them (``SyncJobStore.unwatched``); both count with ``watching``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis.asyncio as aredis

from common.keys import WATCHER_GHOST, Keys


def watching(members: Iterable[tuple[str, float]], now: float, grace_s: float) -> bool:
    """Whether a job's watcher set (Keys.job_watchers: member, score) still watches it at ``now``.

    A watcher counts while its lease runs, and for ``grace_s`` after it lapsed (its API process
    died: its clients get the grace from then to resume elsewhere); a ghost, while its grace runs.
    """
    return any(score >= (now if m.startswith(WATCHER_GHOST) else now - grace_s) for m, score in members)


class WatcherSets:
    """The API's writes of the watcher sets; ``ttl_s``: the expiry each write sets again."""

    redis: aredis.Redis
    keys: Keys

    async def add_watcher(self, job_id: str, token: str, deadline: float, ttl_s: int) -> None:
        key = self.keys.job_watchers(job_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(key, {token: deadline})
            pipe.expire(key, ttl_s)
            await pipe.execute()

    async def renew_watchers(self, watchers: Iterable[tuple[str, str]], deadline: float, ttl_s: int) -> None:
        """Move the deadline of each watcher (token, job id) that is still in its set."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for token, job_id in watchers:
                key = self.keys.job_watchers(job_id)
                pipe.zadd(key, {token: deadline}, xx=True)
                pipe.expire(key, ttl_s)
            await pipe.execute()

    async def ghost_watchers(self, watchers: Mapping[str, str], until: float, ttl_s: int) -> None:
        """Replace each watcher (token -> job id) by its ghost, which counts until ``until``."""
        # NOTE: the ghost is a new member, so a renewal already on its way (ZADD XX) cannot
        # revive the token and stretch the grace.
        async with self.redis.pipeline(transaction=True) as pipe:
            for token, job_id in watchers.items():
                key = self.keys.job_watchers(job_id)
                pipe.zrem(key, token)
                pipe.zadd(key, {WATCHER_GHOST + token: until})
                pipe.expire(key, ttl_s)
            await pipe.execute()

    async def watched(self, job_id: str, now: float, grace_s: float) -> bool:
        """Whether anybody watches the job (see ``watching``); drops the members past counting."""
        key = self.keys.job_watchers(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:  # in order on one connection
            pipe.zremrangebyscore(key, "-inf", f"({now - grace_s!r}")
            pipe.zrange(key, 0, -1, withscores=True)
            _, members = await pipe.execute()
        return watching(members, now, grace_s)
