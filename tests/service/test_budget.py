"""The in-flight byte budget: waiters are served in order, time out, and never leak bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="needs the service extra: pip install 'kvtier[service]'")

import asyncio

from kvtier.service.limits import Budget


def test_waiters_get_room_in_arrival_order() -> None:
    async def go() -> list[str]:
        b = Budget(10, wait_s=5)
        assert await b.acquire(8)
        order: list[str] = []

        async def want(name: str, n: int) -> None:
            assert await b.acquire(n)
            order.append(name)

        big = asyncio.create_task(want("big", 9))
        await asyncio.sleep(0)
        small = asyncio.create_task(want("small", 1))  # would fit now, but queues behind
        await asyncio.sleep(0.01)
        assert order == [] and b.used_bytes == 8
        b.give(8)
        await asyncio.gather(big, small)
        assert b.used_bytes == 10
        return order

    assert asyncio.run(go()) == ["big", "small"]


def test_a_wait_that_runs_out_is_refused_and_holds_nothing() -> None:
    async def go() -> Budget:
        b = Budget(10, wait_s=0.05)
        assert await b.acquire(10)
        assert not await b.acquire(1)
        b.give(10)
        assert await b.acquire(10)  # the refused waiter left no claim behind
        return b

    b = asyncio.run(go())
    assert b.refused == 1 and b.waited == 1 and b.used_bytes == 10


def test_no_wait_and_oversized_requests_are_refused_at_once() -> None:
    async def go() -> None:
        assert not await Budget(10, wait_s=5).acquire(11)
        b = Budget(10, wait_s=0)
        assert await b.acquire(10)
        assert not await b.acquire(1)

    asyncio.run(go())


@pytest.mark.parametrize("granted_first", [True, False])
def test_a_cancelled_waiter_holds_nothing_it_was_not_told_of(granted_first: bool) -> None:
    """A request that goes away while it waits leaves no bytes held: either acquire
    raises and holds nothing, or (its grant won the race) it returns True and the caller
    holds exactly its bytes, to give back as the gate does."""

    async def go() -> tuple[object, int, int]:
        b = Budget(10, wait_s=5)
        assert await b.acquire(10)
        waiter = asyncio.create_task(b.acquire(4))
        await asyncio.sleep(0)
        if granted_first:
            b.give(10)  # grants the waiter's 4 bytes before it runs again
            waiter.cancel()
        else:
            waiter.cancel()
            await asyncio.sleep(0)
            b.give(10)  # nobody waits any more
        (got,) = await asyncio.gather(waiter, return_exceptions=True)
        return got, b.used_bytes, len(b._queue)

    got, used, queued = asyncio.run(go())
    assert queued == 0
    if got is True:
        assert used == 4
    else:
        assert isinstance(got, asyncio.CancelledError) and used == 0
