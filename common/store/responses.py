"""A response of the Responses API: its own fields (input items, instructions, metadata, ...) as
one JSON field of its job's hash, so it lives and expires with the job (``SPOOL_JOB_TTL_S``)."""

from __future__ import annotations

from functools import cached_property

import redis.asyncio as aredis
from redis.commands.core import AsyncScript

from common.keys import Keys
from common.store.scripts import source

RESPONSE_FIELD = "response"
RESPONSE_PREFIX = "resp_"  # a response's id: this and its job's


class ResponseRecords:
    """The API's reads and writes of responses (a part of ``AsyncJobStore``)."""

    redis: aredis.Redis
    keys: Keys

    @cached_property
    def _put_response(self) -> AsyncScript:
        return self.redis.register_script(source("response_put"))

    async def put_response(self, job_id: str, record: str) -> bool:
        """Attach the response's JSON to its job (only to a job that exists: response_put.lua);
        False when the job is gone."""
        return bool(await self._put_response([self.keys.job(job_id)], [RESPONSE_FIELD, record]))

    async def response_of(self, job_id: str) -> tuple[str | None, str | None]:
        """(owner, the response's JSON) of a job; (None, None) for no such job, and a JSON of
        None for a job that is no response (or one deleted)."""
        owner, record = await self.redis.hmget(self.keys.job(job_id), ["owner", RESPONSE_FIELD])
        return (None if owner is None else str(owner)), (None if record is None else str(record))

    async def forget_response(self, job_id: str) -> None:
        """Delete the response (its job's events stay until the job expires)."""
        await self.redis.hdel(self.keys.job(job_id), RESPONSE_FIELD)
