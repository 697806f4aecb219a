"""The API's store of files (OpenAI's Files API), over ``redis.asyncio``: a part of ``AsyncBatchStore``.

A file is a hash (its object) and its lines: a list with one element per line, or with
SPOOL_ARTIFACT_URL set, an artifact (common/artifacts.py) that the index ``Keys.artifacts`` has
deleted when the file expires (``sweep_artifacts``). Either way a batch's feeder reads lines by
index and a file's content is streamed in pages, never read whole. Each owner (API key) has its
own index of files, and its files' bytes for its quota. A batch's result files are written under
the feeder's fence (feeder_claim.lua says how), and committed whole or not at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.commands.core import AsyncScript

from common.artifacts import Artifacts, file_name
from common.keys import Keys
from common.settings import Settings

# An upload's lines (or a result file's) left behind by an API process that died mid-write go
# after this; so does an artifact whose write began this long ago and never ended.
UPLOAD_TTL_S = 3600
UPLOAD_TAG = "upload"  # an upload's artifact is written under this tag; a result file's, its fence
SWEEP_BATCH = 100  # artifacts deleted per sweep at most


class FenceLost(Exception):
    """The feeder's lease is held by another process (or was taken again since): stop writing."""


@dataclass(frozen=True)
class Usage:
    """An owner's stored files: how many, and their bytes."""

    files: int
    bytes: int


# file_reserve.lua's answers
RESERVED, NO_FILE_LEFT, NO_BYTES_LEFT = 1, -1, -2


@dataclass(frozen=True)
class Reservation:
    """What ``reserve_upload`` answered: RESERVED, NO_FILE_LEFT or NO_BYTES_LEFT, and the owner's
    other files (stored, and uploads in progress) with their bytes."""

    status: int
    others: Usage


def hash_or_none(h: dict[Any, Any]) -> dict[str, str] | None:
    """A hash as read (the client decodes replies), None when it does not exist."""
    return {str(k): str(v) for k, v in h.items()} or None


def flat(fields: dict[str, str]) -> list[str]:
    return [x for kv in fields.items() for x in kv]


def _fence_number(fence: str) -> int:
    return int(fence.rpartition(":")[2])


def _tag(fence: str) -> str:
    return str(_fence_number(fence))


class FileRecords:
    """The files' reads and writes (``_scripts``: AsyncBatchStore's, by name)."""

    redis: aredis.Redis
    keys: Keys
    settings: Settings
    artifacts: Artifacts | None
    _scripts: dict[str, AsyncScript]

    # -- files ------------------------------------------------------------------------------------

    async def append_upload(self, file_id: str, lines: Sequence[str]) -> None:
        """Add lines to an upload still arriving (``commit_file`` makes it the file)."""
        if self.artifacts is not None:
            await self._begin(file_id)
            await asyncio.to_thread(self.artifacts.append, file_name(file_id), UPLOAD_TAG, lines)
            return
        key = self.keys.file_upload(file_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, *lines)
            pipe.expire(key, UPLOAD_TTL_S)
            await pipe.execute()

    async def reserve_upload(self, owner: str, file_id: str, size: int) -> Reservation:
        """Room in the owner's quota for the upload ``file_id``, of ``size`` bytes so far: its first
        call takes one of the owner's files, each later one raises its bytes; concurrent uploads
        share the quota (file_reserve.lua). ``commit_file`` keeps it, ``abort_upload`` drops it."""
        k, s, now = self.keys, self.settings, time.time()
        keys = [k.owner_file_bytes(owner), k.owner_file_expiry(owner), k.owner_files(owner)]
        args: list[str | int] = [
            repr(now),
            file_id,
            size,
            s.max_files_per_key,
            s.max_file_bytes_per_key,
            repr(now + UPLOAD_TTL_S),
            UPLOAD_TTL_S,
        ]
        status, files, others = await self._scripts["file_reserve"](keys, args)
        return Reservation(int(status), Usage(int(files), int(others)))

    async def abort_upload(self, file_id: str, owner: str) -> None:
        """Drop an upload's lines and its reservation in its owner's quota."""
        if self.artifacts is not None:
            await asyncio.to_thread(self.artifacts.drop, file_name(file_id), UPLOAD_TAG)
        k = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.file_upload(file_id))
            pipe.hdel(k.owner_file_bytes(owner), file_id)
            pipe.zrem(k.owner_file_expiry(owner), file_id)
            await pipe.execute()

    async def commit_file(self, fields: dict[str, str]) -> None:
        """The upload's lines (``fields["lines"]`` of them) become the file ``fields["id"]``."""
        await self._commit(self.keys.file_upload(fields["id"]), UPLOAD_TAG, "", fields)

    async def _begin(self, file_id: str) -> None:
        """Index a file's artifact being written, so it is deleted should the write never end (a
        later expiry, its file's, stays)."""
        deadline = time.time() + UPLOAD_TTL_S
        await self.redis.zadd(
            self.keys.artifacts(self.keys.bucket_of(file_id)), {file_name(file_id): deadline}, gt=True
        )

    async def _commit(self, upload: str, tag: str, holder: str, fields: dict[str, str]) -> int:
        k, file_id, owner = self.keys, fields["id"], fields["owner"]
        bucket = k.bucket_of(file_id)  # its owner's (routes/files.py, the batch feeder)
        artifact = ""
        if self.artifacts is not None:
            artifact = file_name(file_id)
            await asyncio.to_thread(self.artifacts.seal, artifact, tag, int(fields["lines"]))
        keys = [
            k.batch_feeder(bucket),
            upload,
            k.file_lines(file_id),
            k.file(file_id),
            k.owner_files(owner),
            k.owner_file_bytes(owner),
            k.owner_file_expiry(owner),
            k.artifacts(bucket),
        ]
        args: list[str | int] = [
            holder,
            fields["lines"],
            self.settings.file_ttl_s,
            fields["created_at"],
            file_id,
            fields["bytes"],
            artifact,
        ]
        reply = int(await self._scripts["file_commit"](keys, [*args, *flat(fields)]))
        if reply == -2:
            raise RuntimeError(f"file {file_id}: the upload does not hold {fields['lines']} lines")
        return reply

    async def get_file(self, file_id: str) -> dict[str, str] | None:
        return hash_or_none(await self.redis.hgetall(self.keys.file(file_id)))

    async def list_files(self, owner: str) -> list[dict[str, str]]:
        """The owner's files, newest first; forgets the ids of files that expired."""
        return await self._listed(self.keys.owner_files(owner), self.keys.file)

    async def read_lines(self, file_id: str, start: int, count: int) -> list[str]:
        """Lines ``start`` to ``start + count - 1`` of the file (fewer past its end)."""
        if self.artifacts is not None:
            return await asyncio.to_thread(self.artifacts.read_lines, file_name(file_id), start, count)
        return [
            str(x) for x in await self.redis.lrange(self.keys.file_lines(file_id), start, start + count - 1)
        ]

    async def delete_file(self, file_id: str, owner: str) -> bool:
        k = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.file(file_id), k.file_lines(file_id))
            pipe.zrem(k.owner_files(owner), file_id)
            pipe.hdel(k.owner_file_bytes(owner), file_id)
            pipe.zrem(k.owner_file_expiry(owner), file_id)
            pipe.zrem(k.artifacts(k.bucket_of(file_id)), file_name(file_id))
            deleted, *_ = await pipe.execute()
        if self.artifacts is not None:
            await asyncio.to_thread(self.artifacts.delete, file_name(file_id))
        return bool(deleted)

    async def sweep_artifacts(self, buckets: Iterable[int]) -> int:
        """Delete the artifacts due (their file or image expired, or their write never ended) of
        these buckets; returns how many. The batch feeder calls it at each tick for the buckets
        whose lease it holds."""
        if self.artifacts is None:
            return 0
        swept = 0
        for b in buckets:
            index = self.keys.artifacts(b)
            due = [str(n) for n in await self.redis.zrangebyscore(index, "-inf", time.time(), 0, SWEEP_BATCH)]
            for name in due:
                await asyncio.to_thread(self.artifacts.delete, name)
            if due:
                await self.redis.zrem(index, *due)
            swept += len(due)
        return swept

    # -- a batch's result files, under the feeder's fence ------------------------------------------

    async def append_attempt(self, file_id: str, fence: str, start: int, lines: Sequence[str]) -> None:
        """Append lines ``start`` on of a result file written under ``fence`` (``token:fence``)."""
        if self.artifacts is not None:
            # The file under this fence's tag is this call's own; the commit is what is fenced.
            await self.check_fence(file_id, fence)
            await self._begin(file_id)
            await asyncio.to_thread(self.artifacts.append, file_name(file_id), _tag(fence), lines)
            return
        key = self.keys.file_attempt(file_id, _fence_number(fence))
        reply = int(
            await self._scripts["file_append_attempt"](
                [self.keys.batch_feeder(self.keys.bucket_of(file_id)), key],
                [fence, start, UPLOAD_TTL_S, *lines],
            )
        )
        if reply == -1:
            raise FenceLost(fence)
        if reply == -2:
            raise RuntimeError(f"file {file_id}: the attempt's list does not end at line {start}")

    async def check_fence(self, object_id: str, fence: str) -> None:
        """FenceLost unless the feeder's lease of ``object_id``'s bucket is still held with ``fence``."""
        if await self.redis.get(self.keys.batch_feeder(self.keys.bucket_of(object_id))) != fence:
            raise FenceLost(fence)

    async def drop_attempt(self, file_id: str, fence: str) -> None:
        if self.artifacts is not None:
            await asyncio.to_thread(self.artifacts.drop, file_name(file_id), _tag(fence))
        await self.redis.delete(self.keys.file_attempt(file_id, _fence_number(fence)))

    async def commit_attempt(self, fence: str, fields: dict[str, str]) -> None:
        """The result file written under ``fence`` becomes the file, if the fence still holds.

        With artifacts, the artifact is renamed into place before the fenced commit: a feeder
        that lost the lease writes the same lines under the same name (each line's result is set
        once), and it has no listed file until the holder commits."""
        upload = self.keys.file_attempt(fields["id"], _fence_number(fence))
        if await self._commit(upload, _tag(fence), fence, fields) == -1:
            raise FenceLost(fence)

    async def _listed(self, index: str, key: Any) -> list[dict[str, str]]:
        ids = [str(i) for i in await self.redis.zrevrange(index, 0, -1)]
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(key(i))
            objects = await pipe.execute()
        gone = [i for i, h in zip(ids, objects, strict=True) if not h]
        if gone:
            await self.redis.zrem(index, *gone)
        return [h for h in objects if h]
