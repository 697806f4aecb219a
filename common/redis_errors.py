"""Redis errors that mean "not now": Redis unreachable, or up and refusing writes.

Redis refuses writes while it is out of memory (``maxmemory`` reached under ``noeviction``: an
OOM error; inside MULTI it refuses reads too), while it is a read-only replica (a failover
under way), and while a master set with ``min-replicas-to-write`` sees too few replicas
(NOREPLICAS: its link to them cut, docs/operations.md). Each passes by itself, like a lost connection, so they are handled like one: a
worker retries its writes with backoff (never skipping one), and the API answers 503 with
``Retry-After``.
"""

from __future__ import annotations

from redis._parsers.base import BaseParser
from redis.exceptions import ClusterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class NoReplicasError(ResponseError):
    """NOREPLICAS: a master with ``min-replicas-to-write`` refuses writes while it sees too few
    replicas."""


# NOTE: redis-py has no class of its own for NOREPLICAS (a plain ResponseError); its parsers, the
# hiredis one too, name an error's class by its first word from this table.
BaseParser.EXCEPTION_CLASSES.setdefault("NOREPLICAS", NoReplicasError)

# A Redis Cluster without a master for some slots (CLUSTERDOWN, MASTERDOWN: a failover under way)
# or moving a slot (TRYAGAIN) is unreachable for those keys until it is done.
UNREACHABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
)
WRITE_REFUSED: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError, NoReplicasError)
TRANSIENT: tuple[type[Exception], ...] = UNREACHABLE + WRITE_REFUSED
