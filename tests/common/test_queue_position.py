"""A queued job's place among the jobs its model's workers take before it."""

from __future__ import annotations

import asyncio

from store_helpers import StoreForTests

from common.keys import BATCH_PRIORITY, REQUEUE_PRIORITY, Keys
from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store import AsyncJobStore, QueueMessage
from common.tenants import tenant_of


def positions(settings: Settings, job_ids: list[str]) -> list[int | None]:
    async def go() -> list[int | None]:
        store = AsyncJobStore.from_settings(settings)
        try:
            return [await store.queue_position(j) for j in job_ids]
        finally:
            await store.close()

    return asyncio.run(go())


def test_the_jobs_ahead_are_its_models_in_the_queues_order(settings: Settings) -> None:
    settings = settings.model_copy(update={"max_queued_jobs": 10 * settings.redis_buckets})
    store = StoreForTests.from_settings(settings)
    try:
        check_positions(store, settings)
    finally:
        store.close()


def check_positions(store: StoreForTests, settings: Settings) -> None:
    a, b = settings.keys.model_queue("a"), settings.keys.model_queue("b")

    def create(queue: str, tier: str = "auto") -> str:
        request = JobRequest(prompt="x", service_tier=tier)  # type: ignore[arg-type]
        return store.create_job(request, message_for=lambda j: QueueMessage(f"{queue}:sent", j, queue)).id

    first_a, first_b, flex_a, second_a = create(a), create(b), create(a, "flex"), create(a)
    # a's second job waits for a's first only (b's is another model's, the flex one goes after it);
    # the flex job for both of a's interactive jobs, even the one queued after it.
    assert positions(settings, [first_a, first_b, flex_a, second_a]) == [0, 0, 2, 1]
    # Requeues in a's queue go first; batch lines' messages before a flex job only.
    store.redis.rpush(settings.keys.broker_list(a, REQUEUE_PRIORITY), "r1", "r2")
    store.redis.rpush(settings.keys.broker_list(a, BATCH_PRIORITY), "line")
    assert positions(settings, [first_a, flex_a, second_a]) == [2, 5, 3]
    taken = store.take_job(first_a, "w", "a")
    assert taken.record is not None
    assert positions(settings, [first_a, second_a]) == [None, 2]  # running: none


def test_tenant_queues_take_turns(settings: Settings) -> None:
    """An interactive job waits for its own tenant queue's jobs queued before it, and for as many
    of each other tenant queue's (those queued after it too): the queues take turns."""
    store = StoreForTests.from_settings(
        settings.model_copy(update={"max_queued_jobs": 20 * settings.redis_buckets})
    )
    queue = settings.keys.model_queue("a")
    owners = [f"owner-{i}" for i in range(16)]
    flood = owners[0]
    tenant_queue = lambda owner: Keys.tenant_queue(queue, tenant_of(owner))  # noqa: E731
    trickle = next(o for o in owners if tenant_queue(o) != tenant_queue(flood))

    def create(owner: str) -> str:
        message = lambda j: QueueMessage(f"{queue}:sent", j, queue)  # noqa: E731
        return store.create_job(JobRequest(prompt="x"), owner, message).id

    try:
        backlog = [create(flood) for _ in range(5)]
        late = create(trickle)
        # The trickle job is first in its queue; the backlog's last has 4 of its own ahead and
        # the one trickle job, whose queue has a turn in between.
        assert positions(settings, [late, backlog[0], backlog[1], backlog[-1]]) == [0, 0, 2, 5]
    finally:
        store.close()
