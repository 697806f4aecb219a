"""cancel_until_done: tasks that swallow a cancel (as redis-py's commands can) still end."""

from __future__ import annotations

import asyncio

import pytest

from common.asyncio_tasks import cancel_until_done


async def stubborn(swallowed: asyncio.Event) -> None:
    """Swallows its first cancel, as a redis-py command can (redis/redis-py#2028)."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        swallowed.set()
    await asyncio.sleep(60)


def test_a_swallowed_cancel_is_repeated() -> None:
    async def go() -> None:
        child = asyncio.create_task(stubborn(asyncio.Event()))
        await asyncio.sleep(0)  # started
        await cancel_until_done([child])
        assert child.cancelled()

    asyncio.run(go())


def test_cancelled_while_it_waits_it_still_ends_the_tasks() -> None:
    """A task whose ``finally`` ends its children is cancelled again meanwhile (as
    cancel_until_done does to it): the children end all the same, then the cancel is raised."""

    async def go() -> None:
        swallowed = asyncio.Event()
        child = asyncio.create_task(stubborn(swallowed))

        async def owner() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await cancel_until_done([child])

        parent = asyncio.create_task(owner())
        await asyncio.sleep(0)  # both started
        parent.cancel()
        await swallowed.wait()  # the parent's finally waits on the child
        parent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parent
        assert child.cancelled()

    asyncio.run(go())
