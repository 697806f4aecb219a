"""Ending asyncio tasks that talk to Redis: a cancel is repeated until the task has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.05  # a task that did not end this long after its cancel is cancelled again


async def cancel_until_done(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel the tasks, again and again until each has ended.

    NOTE: one cancel is not enough. A cancel that lands while a task is inside a redis-py command
    can be swallowed (redis/redis-py#2028; about 1 cancel in 10 of a loop of commands here, with
    redis-py 8.1). The task then runs on with ``cancelling() == 1``. A request kept watching a job
    whose client was gone, and an API's shutdown waited on its batch feeder until it was killed.

    Cancelled itself meanwhile (a caller's ``finally`` whose task is cancelled again, as this
    function does to it), it still waits for the tasks to end, then raises CancelledError.
    """
    tasks, cancelled = list(tasks), False
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        try:
            await asyncio.wait(pending, timeout=RECANCEL_S)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
