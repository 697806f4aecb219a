"""A worker's own pops from the broker's queue lists (workers/tenant_intake.py): a message taken
beside Celery's consumer, as kombu's BRPOP takes it, and put back when it could not run."""

from __future__ import annotations

from collections.abc import Sequence

import redis


class BrokerLists:
    def __init__(self, broker: redis.Redis) -> None:
        self.broker = broker  # the broker's Redis (SyncJobStore.broker)

    def pop(self, lists: Sequence[str], timeout_s: int) -> tuple[str, str] | None:
        """(list, message) of the first of ``lists`` to hold one, waiting up to ``timeout_s``."""
        popped = self.broker.brpop(list(lists), timeout=timeout_s)
        return (str(popped[0]), str(popped[1])) if popped else None

    def give_back(self, list_name: str, message: str) -> None:
        """Put a popped message back at its list's tail, where the next pop takes it first."""
        self.broker.rpush(list_name, message)
