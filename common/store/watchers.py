"""Who watches a foreground job: its watcher set (``Keys.job_watchers``), across API processes.

Each stream or wait on a foreground job holds a token in the set, scored with a lease deadline
that its API process renews; one that leaves is replaced by a ghost scored with the end of its
grace (api/watchers.py says why). Every write sets the set's expiry again, so the set goes once
nobody wrote to it for that long. The API writes the sets (``WatcherSets``, a part of
``AsyncJobStore``); a worker reads them (``SyncJobStore.unwatched``); both count with ``watching``.

Every score is a time on Redis's clock (``TIME``), and every count reads that clock too: an API
process or a worker whose own clock is off (a worker 90 s ahead) counts the same as the others.

The key: docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property

import redis.asyncio as aredis
from redis.commands.core import AsyncScript

from common.keys import WATCHER_GHOST, Keys
from common.store.scripts import source


def watching(members: Iterable[tuple[str, float]], now: float, grace_s: float) -> bool:
    """Whether a job's watcher set (Keys.job_watchers: member, score) still watches it at ``now``
    (Redis's clock).

    A watcher counts while its lease runs, and for ``grace_s`` after it lapsed (its API process
    died: its clients get the grace from then to resume elsewhere); a ghost, while its grace runs.
    """
    return any(score >= (now if m.startswith(WATCHER_GHOST) else now - grace_s) for m, score in members)


def pairs(flat: Sequence[str | bytes]) -> list[tuple[str, float]]:
    """(member, score) from a flat ZRANGE WITHSCORES reply of a script."""
    text = [x.decode() if isinstance(x, bytes) else x for x in flat]
    return [(text[i], float(text[i + 1])) for i in range(0, len(text), 2)]


class WatcherSets:
    """The API's writes of the watcher sets; ``ttl_s``: the expiry each write sets again."""

    redis: aredis.Redis
    keys: Keys

    @cached_property
    def _score_watchers(self) -> AsyncScript:
        return self.redis.register_script(source("watchers_score"))

    @cached_property
    def _ghost_watchers(self) -> AsyncScript:
        return self.redis.register_script(source("watchers_ghost"))

    @cached_property
    def _watchers_at(self) -> AsyncScript:
        return self.redis.register_script(source("watchers_at"))

    async def add_watcher(self, job_id: str, token: str, lease_s: float, ttl_s: int) -> None:
        """Add the watcher, its lease ending ``lease_s`` from now."""
        await self._score_watchers([self.keys.job_watchers(job_id)], [lease_s, ttl_s, "", token])

    async def renew_watchers(self, watchers: Iterable[tuple[str, str]], lease_s: float, ttl_s: int) -> None:
        """Move the lease's end of each watcher (token, job id) still in its set to ``lease_s``
        from now (one script call per bucket)."""
        tokens = dict(watchers)
        for group in self._by_bucket(tokens):
            keys = [self.keys.job_watchers(tokens[token]) for token in group]
            await self._score_watchers(keys, [lease_s, ttl_s, "XX", *group])

    async def ghost_watchers(self, watchers: Mapping[str, str], grace_s: float, ttl_s: int) -> float:
        """Replace each watcher (token -> job id) by its ghost, which counts for ``grace_s`` from
        now; returns the end of that grace on Redis's clock (for ``watched``'s ``at``)."""
        # NOTE: the ghost is a new member, so a renewal already on its way (ZADD XX) cannot
        # revive the token and stretch the grace.
        ends = 0.0
        for group in self._by_bucket(watchers):
            keys = [self.keys.job_watchers(watchers[token]) for token in group]
            ends = max(ends, float(await self._ghost_watchers(keys, [grace_s, ttl_s, WATCHER_GHOST, *group])))
        return ends

    def _by_bucket(self, watchers: Mapping[str, str]) -> list[list[str]]:
        """The tokens of these watchers (token -> job id) by their job's bucket."""
        groups: dict[int, list[str]] = {}
        for token, job_id in watchers.items():
            groups.setdefault(self.keys.bucket_of(job_id), []).append(token)
        return list(groups.values())

    async def watched(self, job_id: str, grace_s: float, at: float | None = None) -> bool:
        """Whether anybody watches the job now, or at ``at`` (Redis's clock) if that is later (see
        ``watching``); drops the members past counting."""
        reply = await self._watchers_at([self.keys.job_watchers(job_id)], [grace_s, "" if at is None else at])
        return watching(pairs(reply[1:]), float(reply[0]), grace_s)
