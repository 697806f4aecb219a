"""The broker messages of a job store whose broker is a Redis apart (SPOOL_BROKER_URL).

A script cannot write to another Redis. So with the broker apart, the scripts that store a job
with its message put the message on the data Redis's outbox (``Keys.outbox``), and this module
relays it to its broker list. With one Redis none of this runs. Who relays and what a crash
loses: docs/operations.md#the-broker-apart-spool_broker_url.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import cast

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError

from common.keys import Keys
from common.store.records import QueueMessage

log = logging.getLogger(__name__)

NOT_RELAYED = "broker messages not relayed yet (%s); the next relay sends them"
RELAY_PAGE = 256  # outbox entries popped (and pushed onto the broker) per round trip


def outboxed(keys: Keys, message: QueueMessage, job_id: str) -> QueueMessage:
    """The message of ``job_id`` (or a part's id) as the scripts write it while the broker is
    apart: onto the outbox of the job's bucket."""
    outbox = keys.outbox(keys.bucket_of(job_id))
    return QueueMessage(outbox, json.dumps([message.list_key, message.payload]), message.queue)


def _pairs(entries: list[str]) -> list[tuple[str, str]]:
    return [(str(lst), str(payload)) for lst, payload in map(json.loads, entries)]


class SyncOutbox:
    """The outbox of a data Redis and the broker it relays to (the worker's, over redis.Redis)."""

    def __init__(self, data: redis.Redis, broker: redis.Redis, keys: Keys) -> None:
        self.data, self.broker, self.keys = data, broker, keys

    def relay(self, buckets: Iterable[int] | None = None) -> int:
        """Move every message of the outboxes (of those ``buckets``, or all) onto its broker list;
        returns how many."""
        return sum(self._relay(self.keys.outbox(b)) for b in buckets or self.keys.bucket_range())

    def _relay(self, outbox: str) -> int:
        moved = 0
        while popped := self.data.rpop(outbox, RELAY_PAGE):
            # redis-py types RPOP's reply as one item; with a count it is a list.
            entries = cast(list[str], popped)
            pipe = self.broker.pipeline(transaction=False)
            for lst, payload in _pairs(entries):
                pipe.lpush(lst, payload)
            try:
                pipe.execute()
            except RedisError:
                self.data.rpush(outbox, *reversed(entries))
                raise
            moved += len(entries)
        return moved

    def relay_or_log(self, buckets: Iterable[int] | None = None) -> int:
        """Relay; when a Redis fails, say so and leave the rest to the next relay."""
        try:
            return self.relay(buckets)
        except RedisError as e:
            log.warning(NOT_RELAYED, e)
            return 0


class AsyncOutbox:
    """The same, over redis.asyncio (the API's)."""

    def __init__(self, data: aredis.Redis, broker: aredis.Redis, keys: Keys) -> None:
        self.data, self.broker, self.keys = data, broker, keys

    async def relay(self, buckets: Iterable[int] | None = None) -> int:
        return sum([await self._relay(self.keys.outbox(b)) for b in buckets or self.keys.bucket_range()])

    async def _relay(self, outbox: str) -> int:
        moved = 0
        while popped := await self.data.rpop(outbox, RELAY_PAGE):
            entries = cast(list[str], popped)  # as in SyncOutbox.relay
            async with self.broker.pipeline(transaction=False) as pipe:
                for lst, payload in _pairs(entries):
                    pipe.lpush(lst, payload)
                try:
                    await pipe.execute()
                except RedisError:
                    # Back at the tail, oldest last: the next relay pops them first.
                    await self.data.rpush(outbox, *reversed(entries))
                    raise
            moved += len(entries)
        return moved

    async def relay_or_log(self, buckets: Iterable[int] | None = None) -> None:
        """Relay, and when a Redis fails, say so and leave it to the next relay: the job stored
        is accepted, its message waits in the outbox (or is sent again by a sweep)."""
        try:
            await self.relay(buckets)
        except RedisError as e:
            log.warning(NOT_RELAYED, e)
