"""Group commit: concurrent single writes share batches, and each keeps its own error."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

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
