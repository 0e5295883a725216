"""`ElasticLimit`: a semaphore whose capacity moves."""

from __future__ import annotations

import asyncio

import pytest

from agentflow.rollout.elastic import ElasticLimit


async def _blocked(limit: ElasticLimit) -> asyncio.Task[None]:
    waiter = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    return waiter


async def test_a_release_lets_a_waiter_in() -> None:
    limit = ElasticLimit(1)
    await limit.acquire()
    waiter = await _blocked(limit)
    limit.release()
    await asyncio.wait_for(waiter, 1.0)
    assert limit.held == 1


async def test_raising_the_limit_lets_every_waiter_in_that_fits() -> None:
    limit = ElasticLimit(1)
    await limit.acquire()
    waiters = [await _blocked(limit) for _ in range(3)]
    limit.set_limit(3)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]  # two fit, the third waits
    assert limit.held == 3
    limit.release()
    await asyncio.wait_for(waiters[2], 1.0)
    assert limit.held == 3


async def test_lowering_the_limit_keeps_the_holders_and_holds_back_newcomers() -> None:
    limit = ElasticLimit(3)
    for _ in range(3):
        await limit.acquire()
    limit.set_limit(1)
    assert limit.held == 3
    waiter = await _blocked(limit)
    limit.release()
    limit.release()
    await asyncio.sleep(0)
    assert not waiter.done()  # 1 held of 1
    limit.release()
    await asyncio.wait_for(waiter, 1.0)
    assert limit.held == 1


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_nothing() -> None:
    limit = ElasticLimit(1)
    await limit.acquire()
    waiter = await _blocked(limit)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not limit._waiters
    limit.release()
    assert limit.held == 0


async def test_a_waiter_cancelled_after_its_wake_up_takes_nothing() -> None:
    limit = ElasticLimit(1)
    await limit.acquire()
    waiter = await _blocked(limit)
    limit.release()  # wakes it; it has not run yet
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limit.held == 0
    await asyncio.wait_for(limit.acquire(), 1.0)  # the room is still there
