from __future__ import annotations

import asyncio

import pytest

from sandbox import SandboxError
from sandbox.pool import SandboxPool

from .memory_sandbox import MemorySandbox


async def test_start_fills_and_acquire_hands_out_warm_sandboxes():
    made: list[MemorySandbox] = []

    def factory() -> MemorySandbox:
        made.append(MemorySandbox())
        return made[-1]

    pool = SandboxPool(factory, size=2, max_active=4)
    await pool.start()
    assert pool.idle == 2 and len(made) == 2
    async with pool.acquire() as sb:
        assert sb in made and pool.active == 1
    await asyncio.sleep(0.05)  # let the background refill run
    # one-shot: the used sandbox was closed and replaced
    assert made[0].closed or made[1].closed
    assert pool.idle == 2 and len(made) == 3
    await pool.close()
    assert all(sb.closed for sb in made)


async def test_recycle_resets_and_reuses():
    pool = SandboxPool(MemorySandbox, size=1, recycle=True)
    await pool.start()
    async with pool.acquire() as first:
        await first.write_file("a", "x")
    async with pool.acquire() as second:
        assert second is first
    assert isinstance(first, MemorySandbox)
    assert first.files == {} and first.resets == 2  # reset after each release
    await pool.close()
    assert first.closed


async def test_max_active_bounds_concurrent_borrowers():
    pool = SandboxPool(MemorySandbox, size=0, max_active=2)
    await pool.start()
    peak = 0

    async def borrow():
        nonlocal peak
        async with pool.acquire():
            peak = max(peak, pool.active)
            await asyncio.sleep(0.02)

    await asyncio.gather(*(borrow() for _ in range(6)))
    assert peak == 2
    await pool.close()


async def test_failed_reset_replaces_the_sandbox():
    class Broken(MemorySandbox):
        async def reset(self) -> None:
            raise SandboxError("reset failed")

    pool = SandboxPool(Broken, size=1, recycle=True)
    await pool.start()
    async with pool.acquire() as sb:
        pass
    await asyncio.sleep(0.05)
    assert isinstance(sb, MemorySandbox) and sb.closed
    async with pool.acquire() as other:
        assert other is not sb
    await pool.close()


async def test_closed_pool_refuses_and_bad_sizes_are_refused():
    pool = SandboxPool(MemorySandbox, size=1)
    await pool.close()
    with pytest.raises(SandboxError):
        async with pool.acquire():
            pass
    with pytest.raises(ValueError):
        SandboxPool(MemorySandbox, size=-1)
    with pytest.raises(ValueError):
        SandboxPool(MemorySandbox, max_active=0)
