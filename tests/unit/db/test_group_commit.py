"""Group commit: concurrent single writes share batches, and each keeps its own error."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from agentflow.db.group_commit import WAIT_EDGES_S, GroupCommit, WaitHistogram
from agentflow.errors import InvalidInput
from agentflow.types import NewTurn, TurnRecord


def turn(tokens: tuple[int, ...] = (1,)) -> NewTurn:
    return NewTurn(
        episode_id=uuid.uuid4(), parent_id=None, record=TurnRecord(kind="env", token_ids=tokens)
    )


class FakeStore:
    """Stands in for the database: records batches, refuses turns holding token 13."""

    def __init__(self, delay: float = 0.01) -> None:
        self.batches: list[list[uuid.UUID]] = []
        self.written: list[uuid.UUID] = []
        self.delay = delay

    async def write(self, batch: Sequence[NewTurn]) -> list[None]:
        self.batches.append([t.id for t in batch])
        await asyncio.sleep(self.delay)
        if any(13 in t.record.token_ids for t in batch):
            raise InvalidInput("unlucky token")
        self.written.extend(t.id for t in batch)
        return [None] * len(batch)


async def test_a_lone_turn_is_written_at_once() -> None:
    store = FakeStore()
    one = turn()
    await GroupCommit(store.write).add(one)
    assert store.batches == [[one.id]] and store.written == [one.id]


async def test_concurrent_turns_share_transactions_in_arrival_order() -> None:
    store = FakeStore()
    batcher = GroupCommit(store.write)
    turns = [turn() for _ in range(20)]
    await asyncio.gather(*(batcher.add(t) for t in turns))
    assert store.written == [t.id for t in turns]
    assert len(store.batches) == 1  # all queued before the drain task first ran


async def test_batches_never_exceed_the_cap() -> None:
    store = FakeStore()
    batcher = GroupCommit(store.write, max_batch=4)
    await asyncio.gather(*(batcher.add(turn()) for _ in range(10)))
    assert [len(b) for b in store.batches] == [4, 4, 2]


async def test_only_the_bad_turn_fails() -> None:
    store = FakeStore()
    batcher = GroupCommit(store.write)
    good = [turn() for _ in range(5)]
    bad = turn((13,))
    results = await asyncio.gather(
        *(batcher.add(t) for t in [*good[:2], bad, *good[2:]]), return_exceptions=True
    )
    assert [type(r).__name__ for r in results] == ["NoneType"] * 2 + ["InvalidInput"] + [
        "NoneType"
    ] * 3
    assert sorted(map(str, store.written)) == sorted(str(t.id) for t in good)


async def test_a_cancelled_caller_does_not_break_the_others() -> None:
    store = FakeStore(delay=0.05)
    batcher = GroupCommit(store.write)
    first = asyncio.create_task(batcher.add(turn()))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(batcher.add(turn())) for _ in range(3)]
    await asyncio.sleep(0)
    waiting[0].cancel()
    await asyncio.gather(first, *waiting[1:])
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert len(store.written) == 4  # queued before the cancel: still written


async def test_an_item_failed_by_the_batch_write_fails_alone() -> None:
    async def write(batch: Sequence[int]) -> list[int | Exception]:
        calls.append(list(batch))
        return [InvalidInput(f"odd {n}") if n % 2 else n * 10 for n in batch]

    calls: list[list[int]] = []
    commit: GroupCommit[int, int] = GroupCommit(write)
    results = await asyncio.gather(*(commit.add(n) for n in range(4)), return_exceptions=True)
    assert results[0] == 0 and results[2] == 20
    assert isinstance(results[1], InvalidInput) and str(results[3]) == "odd 3"
    assert calls == [[0, 1, 2, 3]]  # one batch: a per-item error is not a failed write


async def test_each_call_s_wait_is_counted_in_its_bucket() -> None:
    store = FakeStore(delay=0.02)
    commit: GroupCommit[NewTurn, None] = GroupCommit(store.write)
    before = commit.waits.snapshot()
    await asyncio.gather(*(commit.add(turn()) for _ in range(3)), commit.add(turn((13,))),
                         return_exceptions=True)  # fmt: skip
    waited = [b - a for a, b in zip(before, commit.waits.snapshot(), strict=True)]
    assert sum(waited) == 4  # refused calls waited too
    # At least the 20 ms write: nothing in the buckets below 16 ms.
    assert sum(waited[: WAIT_EDGES_S.index(0.016) + 1]) == 0
    p50 = WaitHistogram.quantile(waited, 0.5)
    assert p50 is not None and 0.02 <= p50 <= 0.256


def test_quantiles_are_bucket_edges_and_none_without_calls() -> None:
    histogram = WaitHistogram()
    assert WaitHistogram.quantile(histogram.snapshot(), 0.5) is None
    for seconds in (0.0001, 0.0001, 0.003, 100.0):
        histogram.add(seconds)
    counts = histogram.snapshot()
    assert WaitHistogram.quantile(counts, 0.5) == 0.0005
    assert WaitHistogram.quantile(counts, 0.75) == 0.004
    assert WaitHistogram.quantile(counts, 1.0) == float("inf")


async def test_a_lingering_drain_writes_what_comes_and_then_goes_idle() -> None:
    """With `linger_s`, one drain writes a trickle of lone calls (each at once, none
    waiting for the linger) and calls `on_idle` once, when no call came for that long;
    the next call starts a new drain."""
    store = FakeStore(delay=0.0)
    idle: list[float] = []
    loop = asyncio.get_running_loop()

    async def on_idle() -> None:
        idle.append(loop.time())

    commit: GroupCommit[NewTurn, None] = GroupCommit(store.write, linger_s=0.2, on_idle=on_idle)
    for _ in range(3):
        started = loop.time()
        await commit.add(turn())
        assert loop.time() - started < 0.1  # written at once, not after the linger
        await asyncio.sleep(0.02)
    assert len(store.batches) == 3 and idle == []  # one drain, still holding on
    await asyncio.sleep(0.3)
    assert len(idle) == 1
    await commit.add(turn())
    await asyncio.sleep(0.3)
    assert len(store.written) == 4 and len(idle) == 2


async def test_a_drain_cancelled_while_it_lingers_still_goes_idle() -> None:
    store = FakeStore(delay=0.0)
    idle: list[bool] = []

    async def on_idle() -> None:
        idle.append(True)

    commit: GroupCommit[NewTurn, None] = GroupCommit(store.write, linger_s=10, on_idle=on_idle)
    await commit.add(turn())
    drain = commit._drain_task
    assert drain is not None and not drain.done()
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain
    assert idle == [True]
    await commit.add(turn())  # a new drain takes the next call
    assert len(store.written) == 2
    assert commit._drain_task is not None
    commit._drain_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await commit._drain_task


async def test_gathering_calls_share_a_batch_until_the_oldest_has_waited() -> None:
    """Calls that gather, arriving apart, are written together once the first has waited
    `gather_s`; the wait of each stays inside it (plus the write)."""
    store = FakeStore(delay=0.0)
    batcher = GroupCommit(store.write, gather_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = batcher.submit(turn(), gather=True)
    await asyncio.sleep(0.05)
    second = batcher.submit(turn(), gather=True)
    await asyncio.sleep(0.05)
    assert store.batches == []  # nothing written while the first may still wait
    await asyncio.gather(first, second)
    assert [len(b) for b in store.batches] == [2]
    assert 0.2 <= loop.time() - started < 2.0


async def _held_back(store: FakeStore, n: int) -> tuple[GroupCommit[NewTurn, None], list[Any]]:
    """A batcher that gathers for 30 s, and `n` calls it holds back, unwritten."""
    batcher: GroupCommit[NewTurn, None] = GroupCommit(store.write, gather_s=30.0)
    gathered = [batcher.submit(turn(), gather=True) for _ in range(n)]
    await asyncio.sleep(0.05)
    assert store.batches == []
    return batcher, gathered


async def test_a_call_that_does_not_gather_takes_the_gathered_ones_along_at_once() -> None:
    store = FakeStore(delay=0.0)
    batcher, gathered = await _held_back(store, 3)
    urgent = turn()
    await asyncio.wait_for(batcher.add(urgent), 5)  # not 30 s
    await asyncio.gather(*gathered)
    assert [len(b) for b in store.batches] == [4] and store.written[-1] == urgent.id


async def test_a_full_batch_of_gathering_calls_is_written_at_once() -> None:
    store = FakeStore(delay=0.0)
    batcher = GroupCommit(store.write, max_batch=4, gather_s=30.0)
    turns = [turn() for _ in range(6)]
    futures = [batcher.submit(t, gather=True) for t in turns]
    await asyncio.wait_for(asyncio.gather(*futures[:4]), 5)
    assert store.batches[0] == [t.id for t in turns[:4]]
    # The two past the full batch were queued behind it: written next, not after 30 s.
    await asyncio.wait_for(asyncio.gather(*futures[4:]), 5)
    assert [len(b) for b in store.batches] == [4, 2]


async def test_a_drain_cancelled_while_gathering_cancels_its_callers() -> None:
    store = FakeStore(delay=0.0)
    batcher = GroupCommit(store.write, gather_s=30.0)
    future = batcher.submit(turn(), gather=True)
    await asyncio.sleep(0.01)
    assert batcher._drain_task is not None
    batcher._drain_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await batcher._drain_task
    assert future.cancelled() and store.batches == []
    # The batcher works afterwards: a new call is written at once.
    await asyncio.wait_for(batcher.add(turn()), 5)
    assert len(store.batches) == 1


async def test_hurry_writes_what_gathers_at_once() -> None:
    store = FakeStore(delay=0.0)
    batcher, futures = await _held_back(store, 3)
    batcher.hurry()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert [len(b) for b in store.batches] == [3]
    batcher.hurry()  # nothing queued: nothing to do
