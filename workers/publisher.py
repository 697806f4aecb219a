"""Writes job log entries (``Append``) in one Redis round trip, retrying while Redis is
unreachable, and sorts the replies by job. Shared by the text and media workers; a text job's
appends are built in workers/appends.py.

The write and its answers (written, fenced, a gap):
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.redis_errors import TRANSIENT, WRITE_REFUSED
from common.store import Append, Appended, SyncJobStore

log = logging.getLogger(__name__)

RETRY_MAX_S = 2.0  # longest pause between two tries while Redis is unreachable or refuses writes
OUTBOX_STEPS = 2  # steps whose entries may wait for the writer before the engine thread waits too

Outbox = queue.Queue[list[Append] | None]  # each step's appends; None after the last


def drain(outbox: Outbox) -> tuple[list[Append], bool]:
    """The appends of the next step and of every step waiting behind it, for one round trip (a
    writer that fell behind catches up in fewer, larger calls); and whether the last step came
    (None)."""
    steps = [outbox.get()]
    with contextlib.suppress(queue.Empty):
        while True:
            steps.append(outbox.get_nowait())
    return [a for step in steps if step is not None for a in step], None in steps


def write_steps(outbox: Outbox, write: Callable[[list[Append]], object]) -> None:
    """Hand ``write`` the steps' appends in order, what waits in one call, until the last step."""
    last = False
    while not last:
        appends, last = drain(outbox)
        if appends:
            write(appends)


@dataclass(frozen=True)
class Sent:
    """What became of a round trip's appends, by job."""

    finished: set[str]  # their terminal events are written
    lost: set[str]  # refused: another worker took the job over (fencing)
    gaps: set[str]  # refused: the log does not end where this worker's next event starts


class Publisher:
    def __init__(self, store: SyncJobStore, stop: threading.Event) -> None:
        self.store = store
        self.stop = stop  # set at shutdown: stop retrying against an unreachable Redis

    def send(self, appends: Sequence[Append]) -> Sent:
        """Write ``appends`` in one round trip, retrying until Redis takes them."""
        replies = self._send(appends)
        by_reply: dict[Appended, set[str]] = {r: set() for r in Appended}
        for a, reply in zip(appends, replies, strict=True):
            by_reply[reply].add(a.job_id)
        lost, gaps = by_reply[Appended.FENCED], by_reply[Appended.GAP] - by_reply[Appended.FENCED]
        ended = {a.job_id for a, r in zip(appends, replies, strict=True) if r is Appended.WRITTEN and a.final}
        return Sent(ended - lost - gaps, lost, gaps)

    def _send(self, appends: Sequence[Append]) -> list[Appended]:
        # The appends are idempotent (the store skips entries already in the log), so a try that
        # failed halfway can be sent again as it is. NOTE: a write Redis refused (out of memory,
        # a read-only replica) is retried like a lost connection, never skipped: the next step's
        # append would find a gap in the log.
        pause = 0.05
        while True:
            try:
                return self.store.append_batch(appends)
            except TRANSIENT as e:
                if self.stop.is_set():
                    raise
                why = "refused the writes" if isinstance(e, WRITE_REFUSED) else "unreachable"
                log.warning("redis %s while publishing (%s); retrying in %.2fs", why, e, pause)
                self.stop.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
