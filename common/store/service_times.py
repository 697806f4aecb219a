"""How long a model's jobs hold a slot, and when a queued job can be expected to start.

Each text worker records, when a job ends, the seconds from its take to its end under its
model's queue (``Keys.service_times``: the latest SERVICE_SAMPLES, newest first). The API reads
their mean with the live workers' heartbeats (slots, requests held) to give a queued job its
``estimated_start_s`` (docs/internals.md, "Queue position").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError

from common.keys import Keys
from common.schemas.views import WorkerHeartbeat

log = logging.getLogger(__name__)

SERVICE_SAMPLES = 50  # the latest jobs of a model whose service times are averaged
SERVICE_TTL_S = 24 * 3600  # a model that ran nothing for this long has no basis any more
_FIELDS = ("queue", "started_at", "finished_at", "attempt")


def record_service_times(client: redis.Redis, keys: Keys, job_ids: Sequence[str]) -> None:
    """Record the service time of these jobs, which just ended (their last append was written).

    A job taken over (attempt > 1) is left out: its ``started_at`` is its first worker's take.
    Best effort: a Redis error is logged, never raised (the job's end is already written).
    """
    if not job_ids:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), _FIELDS)
        rows = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for queue, started, finished, attempt in rows:
            if not (queue and started and finished) or int(attempt or 0) > 1:
                continue
            key = keys.service_times(str(queue))
            pipe.lpush(key, max(0.0, float(finished) - float(started)))
            pipe.ltrim(key, 0, SERVICE_SAMPLES - 1)
            pipe.expire(key, SERVICE_TTL_S)
        pipe.execute()
    except RedisError as e:
        log.warning("recording the service times of %d jobs: %s", len(job_ids), e)


async def mean_service_s(client: aredis.Redis, keys: Keys, queue: str) -> float | None:
    """The mean service time of the queue's latest jobs; None before any ended (or after the TTL)."""
    samples = [float(s) for s in await client.lrange(keys.service_times(queue), 0, -1)]
    return sum(samples) / len(samples) if samples else None


def model_load(workers: Iterable[WorkerHeartbeat], keys: Keys, queue: str) -> tuple[int, int] | None:
    """The slots of the live text workers consuming ``queue``, and the requests their engines
    hold (running and waiting, batch lines included); None when no such worker is live."""
    mine = [w for w in workers if w.kind == "text" and keys.model_queue(w.model) == queue]
    if not mine:
        return None
    slots = sum(int(w.engine.get("slots", 0)) for w in mine)
    held = sum(int(w.engine.get("running", 0)) + int(w.engine.get("waiting", 0)) for w in mine)
    return slots, held


def estimate_start_s(position: int, slots: int, held: int, service_s: float | None) -> float | None:
    """Seconds until a queued job gets a slot.

    The jobs before it (``held`` in the engines, then ``position`` in the queue) fill the
    ``slots``, and each slot frees once per ``service_s`` on average. So the job starts after
    ``held + position - slots + 1`` of them end, at ``slots / service_s`` a second. 0 means a slot
    is free for it now. None means there is no basis (no slot, or no job of the model ended yet)."""
    if service_s is None or slots <= 0:
        return None
    ends_needed = held + position - slots + 1
    return round(max(0, ends_needed) * service_s / slots, 1)
