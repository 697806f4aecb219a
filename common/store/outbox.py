"""The broker messages of a job store whose broker is a Redis apart (SPOOL_BROKER_URL).

With one Redis, the scripts that create a job (or feed a batch line, resend a lost line, send a
held or dependent image part) push its message onto the broker's list themselves, so a job and
its message exist together or not at all. A script cannot write to another Redis, so with the
broker apart the message goes, in the same script, onto the data Redis's outbox
(``Keys.outbox``, as JSON ``[broker list, message]``) and is relayed from there: popped (RPOP,
oldest first, so each is claimed by one relayer) and pushed onto its broker list.

Who relays: the process that just ran such a script (the API after a create, the batch feeder
after a feed or resend, a worker after a part's append or a held part's release), and every
worker's sweep once a heartbeat (workers/reaper.py), which also delivers what waited out a broker
that was down. A message popped and not pushed (its relayer died in between, or the broker
refused it and the data Redis the giving back) is lost like a message Redis lost: the sweeps
that send lost messages again cover it (the reaper's for queued jobs and parts, the batch
feeder's for batch lines), once a lease.

With one Redis none of this runs: the messages go straight onto the broker's lists.
"""

from __future__ import annotations

import json
import logging

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError

from common.keys import Keys
from common.store.records import QueueMessage

log = logging.getLogger(__name__)

NOT_RELAYED = "broker messages not relayed yet (%s); the next relay sends them"
RELAY_PAGE = 256  # outbox entries popped (and pushed onto the broker) per round trip


def outboxed(keys: Keys, message: QueueMessage) -> QueueMessage:
    """The message as the scripts write it while the broker is apart: onto the outbox."""
    return QueueMessage(keys.outbox(), json.dumps([message.list_key, message.payload]), message.queue)


def _pairs(entries: list[str]) -> list[tuple[str, str]]:
    return [(str(lst), str(payload)) for lst, payload in map(json.loads, entries)]


class SyncOutbox:
    """The outbox of a data Redis and the broker it relays to (the worker's, over redis.Redis)."""

    def __init__(self, data: redis.Redis, broker: redis.Redis, keys: Keys) -> None:
        self.data, self.broker, self.key = data, broker, keys.outbox()

    def relay(self) -> int:
        """Move every message of the outbox onto its broker list; returns how many."""
        moved = 0
        while entries := self.data.rpop(self.key, RELAY_PAGE):
            pipe = self.broker.pipeline(transaction=False)
            for lst, payload in _pairs(entries):  # type: ignore[arg-type]  # redis-py: RPOP with a count replies a list
                pipe.lpush(lst, payload)
            try:
                pipe.execute()
            except RedisError:
                self.data.rpush(self.key, *reversed(entries))
                raise
            moved += len(entries)
        return moved

    def relay_or_log(self) -> int:
        """Relay; when a Redis fails, say so and leave the rest to the next relay."""
        try:
            return self.relay()
        except RedisError as e:
            log.warning(NOT_RELAYED, e)
            return 0


class AsyncOutbox:
    """The same, over redis.asyncio (the API's)."""

    def __init__(self, data: aredis.Redis, broker: aredis.Redis, keys: Keys) -> None:
        self.data, self.broker, self.key = data, broker, keys.outbox()

    async def relay(self) -> int:
        moved = 0
        while entries := await self.data.rpop(self.key, RELAY_PAGE):
            async with self.broker.pipeline(transaction=False) as pipe:
                for lst, payload in _pairs(entries):  # type: ignore[arg-type]  # redis-py: RPOP with a count replies a list
                    pipe.lpush(lst, payload)
                try:
                    await pipe.execute()
                except RedisError:
                    # Back at the tail, oldest last: the next relay pops them first.
                    await self.data.rpush(self.key, *reversed(entries))
                    raise
            moved += len(entries)
        return moved

    async def relay_or_log(self) -> None:
        """Relay, and when a Redis fails, say so and leave it to the next relay: the job stored
        is accepted, its message waits in the outbox (or is sent again by a sweep)."""
        try:
            await self.relay()
        except RedisError as e:
            log.warning(NOT_RELAYED, e)
