"""`StalenessGate`: admission in groups, bounded by the trainer's version and by the fresh
groups it has taken."""

from __future__ import annotations

import asyncio

from agentflow.rollout.gate import StalenessGate


async def _admit_all(gate: StalenessGate) -> int:
    admitted = 0
    while gate.open():
        await gate.admit_group()
        admitted += 1
    return admitted


async def test_admits_max_staleness_plus_one_batches_ahead() -> None:
    gate = StalenessGate(max_staleness=2, batch_episodes=32, group_size=8)  # 4 groups a batch
    assert await _admit_all(gate) == 12
    await gate.advance(1)
    assert not gate.open()  # a version alone admits nothing: nothing was taken
    await gate.groups_taken(4)
    assert await _admit_all(gate) == 4


async def test_replayed_steps_advance_the_version_but_not_admission() -> None:
    gate = StalenessGate(max_staleness=0, batch_episodes=8, group_size=4)  # 2 groups a batch
    await _admit_all(gate)
    await gate.groups_taken(2)
    for version in (1, 2, 3):  # the trainer steps on replays: nothing new taken
        await gate.advance(version)
    assert await _admit_all(gate) == 2
    assert gate.admitted == 4


async def test_a_refund_reopens_and_waiters_wake() -> None:
    gate = StalenessGate(max_staleness=0, batch_episodes=4, group_size=4)
    await gate.admit_group()
    waiter = asyncio.create_task(gate.admit_group())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await gate.refund_group()
    await asyncio.wait_for(waiter, 1)
    assert gate.refunded == 1 and gate.admitted == 1
