"""Redis errors that mean "not now": Redis unreachable, or up and refusing writes.

Redis refuses writes while it is out of memory (``maxmemory`` reached under ``noeviction``: an
OOM error; inside MULTI it refuses reads too) and while it is a read-only replica (a failover
under way). Both pass by themselves, like a lost connection, so they are handled like one: a
worker retries its writes with backoff (never skipping one), and the API answers 503 with
``Retry-After``.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

UNREACHABLE: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
WRITE_REFUSED: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError)
TRANSIENT: tuple[type[Exception], ...] = UNREACHABLE + WRITE_REFUSED
