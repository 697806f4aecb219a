"""Buckets of the job data (issue 31): the hash tags that put the keys each script touches in one
Redis Cluster slot. How the keys use them: common/keys.py."""

from __future__ import annotations

import functools
import hashlib

from redis import crc

# Buckets (issue 31): on a Redis Cluster each key Spool's scripts touch together must live in one
# hash slot. So every key of the job data belongs to a bucket, whose hash tag ("{...}") it
# carries: a job's keys, and the sets across jobs split per bucket (queued, running, leases'
# attempts, the outbox, ...). A job's bucket is a hash of its id (of its job's id for a part), and
# an id is drawn until it lands in the bucket it must share: a batch's line jobs, files and the
# batch itself sit in their owner's bucket, a job created with an Idempotency-Key in its key's.
# Sweeps walk every bucket. On a standalone Redis there is one bucket and no tag: the names are
# the ones Spool has always used. The tags are chosen so the buckets' slots are evenly spaced
# over the 16,384: a cluster that splits the slots in equal ranges (redis-cli --cluster create
# does) gets the same number of buckets on each of 2, 3, 4, 6, 8 or 12 masters.
CLUSTER_BUCKETS = 24
CLUSTER_SLOTS = 16384


def key_slot(name: str) -> int:
    """The Redis Cluster hash slot of a key or shard channel: CRC16 of its hash tag, if any."""
    return int(crc.key_slot(name.encode()))


@functools.cache
def bucket_tags(buckets: int) -> tuple[str, ...]:
    """The hash tag of each bucket (empty for a single bucket): bucket i's slot lies in the i-th
    of ``buckets`` equal ranges of slots."""
    if buckets == 1:
        return ("",)
    tags = []
    for i in range(buckets):
        low, high = i * CLUSTER_SLOTS // buckets, (i + 1) * CLUSTER_SLOTS // buckets
        tags.append(next(t for n in range(1 << 20) if low <= key_slot(t := f"b{i}.{n}") < high))
    return tuple(tags)


@functools.lru_cache(maxsize=1 << 16)  # a step names each of its jobs' keys: four per job
def bucket_of_root(root_id: str, buckets: int) -> int:
    """The bucket of an id that names no part (common.keys.Keys.bucket_of)."""
    return int.from_bytes(hashlib.blake2b(root_id.encode(), digest_size=4).digest(), "big") % buckets
