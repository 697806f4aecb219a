"""The API's store of files (OpenAI's Files API), over ``redis.asyncio``: a part of ``AsyncBatchStore``.

A file is a hash (its object) and a list with one element per line, so a batch's feeder reads
lines by index and a file's content is streamed in pages, never read whole. Each owner (API key)
has its own index of files, and its files' bytes for its quota. A batch's result files are
written under the feeder's fence (feeder_claim.lua says how), and committed whole or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.commands.core import AsyncScript

from common.keys import Keys
from common.settings import Settings

UPLOAD_TTL_S = 3600  # an upload's lines left behind by an API process that died mid-upload go


class FenceLost(Exception):
    """The feeder's lease is held by another process (or was taken again since): stop writing."""


@dataclass(frozen=True)
class Usage:
    """An owner's stored files: how many, and their bytes."""

    files: int
    bytes: int


def hash_or_none(h: dict[Any, Any]) -> dict[str, str] | None:
    """A hash as read (the client decodes replies), None when it does not exist."""
    return {str(k): str(v) for k, v in h.items()} or None


def flat(fields: dict[str, str]) -> list[str]:
    return [x for kv in fields.items() for x in kv]


def _fence_number(fence: str) -> int:
    return int(fence.rpartition(":")[2])


class FileRecords:
    """The files' reads and writes (``_scripts``: AsyncBatchStore's, by name)."""

    redis: aredis.Redis
    keys: Keys
    settings: Settings
    _scripts: dict[str, AsyncScript]

    # -- files ------------------------------------------------------------------------------------

    async def append_upload(self, file_id: str, lines: Sequence[str]) -> None:
        """Add lines to an upload still arriving (``commit_file`` makes it the file)."""
        key = self.keys.file_upload(file_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, *lines)
            pipe.expire(key, UPLOAD_TTL_S)
            await pipe.execute()

    async def abort_upload(self, file_id: str) -> None:
        await self.redis.delete(self.keys.file_upload(file_id))

    async def commit_file(self, fields: dict[str, str]) -> None:
        """The upload's lines (``fields["lines"]`` of them) become the file ``fields["id"]``."""
        await self._commit(self.keys.file_upload(fields["id"]), "", fields)

    async def _commit(self, upload: str, holder: str, fields: dict[str, str]) -> int:
        k, file_id, owner = self.keys, fields["id"], fields["owner"]
        keys = [
            k.batch_feeder(),
            upload,
            k.file_lines(file_id),
            k.file(file_id),
            k.owner_files(owner),
            k.owner_file_bytes(owner),
            k.owner_file_expiry(owner),
        ]
        args: list[str | int] = [
            holder,
            fields["lines"],
            self.settings.file_ttl_s,
            fields["created_at"],
            file_id,
        ]
        reply = int(await self._scripts["file_commit"](keys, [*args, fields["bytes"], *flat(fields)]))
        if reply == -2:
            raise RuntimeError(f"file {file_id}: the upload does not hold {fields['lines']} lines")
        return reply

    async def get_file(self, file_id: str) -> dict[str, str] | None:
        return hash_or_none(await self.redis.hgetall(self.keys.file(file_id)))

    async def list_files(self, owner: str) -> list[dict[str, str]]:
        """The owner's files, newest first; forgets the ids of files that expired."""
        return await self._listed(self.keys.owner_files(owner), self.keys.file)

    async def usage(self, owner: str) -> Usage:
        """The owner's stored files and their bytes (for its quota); forgets those that expired."""
        k = self.keys
        keys = [k.owner_file_bytes(owner), k.owner_file_expiry(owner), k.owner_files(owner)]
        files, size = await self._scripts["file_usage"](keys, [repr(time.time())])
        return Usage(int(files), int(size))

    async def read_lines(self, file_id: str, start: int, count: int) -> list[str]:
        """Lines ``start`` to ``start + count - 1`` of the file (fewer past its end)."""
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
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    # -- a batch's result files, under the feeder's fence ------------------------------------------

    async def append_attempt(self, file_id: str, fence: str, start: int, lines: Sequence[str]) -> None:
        """Append lines ``start`` on of a result file written under ``fence`` (``token:fence``)."""
        key = self.keys.file_attempt(file_id, _fence_number(fence))
        reply = int(
            await self._scripts["file_append_attempt"](
                [self.keys.batch_feeder(), key], [fence, start, UPLOAD_TTL_S, *lines]
            )
        )
        if reply == -1:
            raise FenceLost(fence)
        if reply == -2:
            raise RuntimeError(f"file {file_id}: the attempt's list does not end at line {start}")

    async def drop_attempt(self, file_id: str, fence: str) -> None:
        await self.redis.delete(self.keys.file_attempt(file_id, _fence_number(fence)))

    async def commit_attempt(self, fence: str, fields: dict[str, str]) -> None:
        """The result file written under ``fence`` becomes the file, if the fence still holds."""
        upload = self.keys.file_attempt(fields["id"], _fence_number(fence))
        if await self._commit(upload, fence, fields) == -1:
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
