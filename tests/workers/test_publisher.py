"""The writer's drain (workers/publisher.py): what waits in the outbox goes in one call."""

from __future__ import annotations

import queue

from common.store import Append, token_entry
from workers.publisher import OUTBOX_STEPS, Outbox, drain


def step(n: int) -> list[Append]:
    """Step ``n``'s appends of two jobs."""
    return [Append(job, 1, [token_entry(n, n - 1, f" {n}", [n])], 4, n) for job in ("a", "b")]


def test_a_writer_behind_takes_every_waiting_step_in_one_call_in_order() -> None:
    outbox: Outbox = queue.Queue(maxsize=OUTBOX_STEPS + 1)
    for n in (1, 2, 3):
        outbox.put(step(n))
    appends, last = drain(outbox)
    assert [(a.job_id, a.entries[0].seq) for a in appends] == [(j, n) for n in (1, 2, 3) for j in "ab"]
    assert not last and outbox.empty()


def test_the_last_step_ends_the_writer_after_its_appends() -> None:
    outbox: Outbox = queue.Queue()
    outbox.put(step(1))
    outbox.put(None)
    appends, last = drain(outbox)
    assert len(appends) == 2 and last
    outbox.put(None)
    assert drain(outbox) == ([], True)
