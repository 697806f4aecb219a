"""A response of the Responses API: its own fields (input items, instructions, metadata, ...) as
one JSON field of its job's hash, so it lives and expires with the job (``SPOOL_JOB_TTL_S``)."""

from __future__ import annotations

import redis.asyncio as aredis

from common.keys import Keys

RESPONSE_FIELD = "response"
RESPONSE_PREFIX = "resp_"  # a response's id: this and its job's

# Set the field only on a job that exists: a job already expired must not come back as a hash
# without an expiry.
PUT_RESPONSE_LUA = """
-- KEYS[1] = the job's hash
-- ARGV[1] = the field, ARGV[2] = the response's JSON
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class ResponseRecords:
    """The API's reads and writes of responses (a part of ``AsyncJobStore``)."""

    redis: aredis.Redis
    keys: Keys

    async def put_response(self, job_id: str, record: str) -> bool:
        """Attach the response's JSON to its job; False when the job is gone."""
        script = self.redis.register_script(PUT_RESPONSE_LUA)
        return bool(await script([self.keys.job(job_id)], [RESPONSE_FIELD, record]))

    async def response_of(self, job_id: str) -> tuple[str | None, str | None]:
        """(owner, the response's JSON) of a job; (None, None) for no such job, and a JSON of
        None for a job that is no response (or one deleted)."""
        owner, record = await self.redis.hmget(self.keys.job(job_id), ["owner", RESPONSE_FIELD])
        return (None if owner is None else str(owner)), (None if record is None else str(record))

    async def forget_response(self, job_id: str) -> None:
        """Delete the response (its job's events stay until the job expires)."""
        await self.redis.hdel(self.keys.job(job_id), RESPONSE_FIELD)
