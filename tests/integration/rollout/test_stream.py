"""The durable trajectory stream on real PostgreSQL and SQLite: leases, acks, replay,
staleness, and a trainer that dies mid-step."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import pytest

from agentflow.db.turn_tree import TurnTree
from agentflow.errors import InvalidInput
from agentflow.rollout.gate import StalenessGate
from agentflow.rollout.stream import DbTrajectoryStream
from tests.integration.rollout.stream_fixtures import (
    finished_group,
    make_run,
    open_episode,
    set_version,
)

pytestmark = pytest.mark.integration


def _stream(turns: TurnTree, run_id: uuid.UUID, **kw: Any) -> DbTrajectoryStream:
    kw.setdefault("group_size", 2)
    kw.setdefault("poll_s", 0.05)
    return DbTrajectoryStream(turns, run_id, **kw)


async def test_pull_leases_whole_finished_groups_oldest_first(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    first = await finished_group(turn_tree, run, 2)
    second = await finished_group(turn_tree, run, 2)
    # A group with an episode still running is not served yet.
    waiting = uuid.uuid4().hex
    await open_episode(turn_tree, run, waiting, 0)
    stream = _stream(turn_tree, run)

    batch = await stream.pull(3)  # two groups of two do not fit in 3: only whole groups
    assert [t.group_id for t in batch] == [first, first]
    assert len({t.lease_id for t in batch}) == 1 and batch[0].lease_id
    rest = await stream.pull(10)
    assert [t.group_id for t in rest] == [second, second]
    assert await stream.pull(10) == []  # leased ones and the open group stay out


async def test_a_pull_splits_the_first_group_only_when_nothing_else_fits(
    turn_tree: TurnTree,
) -> None:
    # More groups wait than a pull can take: it reads only as many as it can take, in
    # serving order, so what it takes is what a read of the whole backlog would give.
    run = await make_run(turn_tree)
    groups = [await finished_group(turn_tree, run, 2) for _ in range(4)]
    stream = _stream(turn_tree, run)

    (half,) = await stream.pull(1)  # no group fits in 1: the first is split
    assert half.group_id == groups[0]
    batch = await stream.pull(4)  # the first group's other half, then one whole group
    assert [t.group_id for t in batch] == [groups[0], groups[1], groups[1]]
    assert {t.id for t in batch}.isdisjoint({half.id})
    assert [t.group_id for t in await stream.pull(2)] == [groups[2]] * 2
    assert [t.group_id for t in await stream.pull(10)] == [groups[3]] * 2


async def test_an_expired_lease_is_served_again(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    await finished_group(turn_tree, run, 2)
    # Seconds: a loaded machine can take longer than a short lease between two pulls.
    stream = _stream(turn_tree, run, lease_s=2.0)
    first = await stream.pull(10)
    assert len(first) == 2 and await stream.pull(10) == []
    await asyncio.sleep(2.1)
    again = await stream.pull(10)
    assert {t.id for t in again} == {t.id for t in first}
    assert again[0].lease_id != first[0].lease_id
    assert stream.counters.expired_leases == 2


async def test_a_resent_pull_gets_its_lease_back_instead_of_more(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    await finished_group(turn_tree, run, 2)
    await finished_group(turn_tree, run, 2)
    # Seconds apart, with a second or more to spare either way on a loaded machine.
    stream = _stream(turn_tree, run, lease_s=3.0)
    lease = uuid.uuid4().hex
    first = await stream.pull(2, lease_id=lease)
    assert len(first) == 2 and {t.lease_id for t in first} == {lease}
    # Its answer was lost; the caller sends the same pull again, past half the lease.
    await asyncio.sleep(1.8)
    again = await stream.pull(2, lease_id=lease)
    assert [t.id for t in again] == [t.id for t in first]
    await asyncio.sleep(1.8)  # the first lease would have expired by now: renewed
    other = await stream.pull(10)
    assert {t.id for t in other}.isdisjoint(t.id for t in first) and len(other) == 2
    assert stream.counters.served_fresh == 4 and stream.counters.expired_leases == 0
    assert await stream.ack([t.id for t in again], lease) == 2
    # Once acknowledged, the id leases afresh (nothing of it is leased any more).
    assert await stream.pull(2, lease_id=lease) == []
    with pytest.raises(InvalidInput) as bad:
        await stream.pull(2, lease_id="not-hex")
    assert bad.value.field == ("lease_id",)


async def test_ack_is_idempotent_and_bound_to_its_lease(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    await finished_group(turn_tree, run, 2)
    stream = _stream(turn_tree, run)
    batch = await stream.pull(10)
    ids = [t.id for t in batch]
    assert await stream.ack(ids, "not-the-lease") == 0
    assert await stream.ack(ids, batch[0].lease_id) == 2
    assert await stream.ack(ids, batch[0].lease_id) == 0  # a repeat counts nothing
    assert await stream.ack(ids) == 0
    stored = await turn_tree.trajectories(ids)
    assert {(t.status, t.times_served) for t in stored} == {("consumed", 1)}
    assert await stream.pull(10) == []


async def test_a_trainer_that_dies_mid_step_loses_nothing_and_trains_nothing_twice(
    turn_tree: TurnTree,
) -> None:
    run = await make_run(turn_tree)
    for _ in range(3):
        await finished_group(turn_tree, run, 2)
    trained: Counter[object] = Counter()

    # Trainer 1 leases a batch and dies before its step commits: no ack.
    dead = _stream(turn_tree, run, lease_s=0.2)
    lost = await dead.pull(2)
    # Trainer 2 commits a step (its checkpoint holds the batch and lease) and dies
    # before acknowledging; the lease expires meanwhile.
    committed = await _stream(turn_tree, run, lease_s=0.2).pull(2)
    trained.update(t.id for t in committed)
    await asyncio.sleep(0.3)

    # The restarted trainer first acknowledges its checkpointed batch, then goes on.
    trainer = _stream(turn_tree, run, lease_s=30)
    assert await trainer.ack([t.id for t in committed], committed[0].lease_id) == 2
    while batch := await trainer.pull(2):
        trained.update(t.id for t in batch)
        await trainer.ack([t.id for t in batch], batch[0].lease_id)

    assert {t.id for t in lost} <= set(trained)  # the uncommitted batch came back
    assert len(trained) == 6 and set(trained.values()) == {1}  # each trained exactly once


async def test_replay_fills_in_only_when_fresh_ones_are_short(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    old = await finished_group(turn_tree, run, 2)
    stream = _stream(turn_tree, run, max_reuse=2)
    first = await stream.pull(2)
    await stream.ack([t.id for t in first], first[0].lease_id)
    fresh = await finished_group(turn_tree, run, 2)

    batch = await stream.pull(4)  # fresh first, then the replay
    assert [t.group_id for t in batch] == [fresh, fresh, old, old]
    assert [t.times_served for t in batch] == [0, 0, 1, 1]
    await stream.ack([t.id for t in batch], batch[0].lease_id)
    assert stream.counters.served_replay == 2
    # `old` has now been trained twice (max_reuse): only `fresh` can replay once more.
    again = await stream.pull(4)
    assert [t.group_id for t in again] == [fresh, fresh]


async def test_staleness_bound_drops_or_downweights(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    stale = await finished_group(turn_tree, run, 2, version=0)
    ok = await finished_group(turn_tree, run, 2, version=2)
    await set_version(turn_tree, run, 4)
    gate = StalenessGate(max_staleness=2, batch_episodes=2, group_size=2)
    stream = _stream(turn_tree, run, max_staleness=2)
    stream.gate = gate
    batch = await stream.pull(10)
    assert {t.group_id for t in batch} == {ok}
    assert all(t.staleness(4) <= 2 for t in batch)  # no served token older than the bound
    assert stream.counters.dropped_stale == 2 and gate.refunded == 1  # one group refunded
    assert stream.counters.staleness == Counter({2: 2})

    run2 = await make_run(turn_tree, version=4)
    await finished_group(turn_tree, run2, 2, version=0)
    soft = _stream(turn_tree, run2, max_staleness=2, stale_policy="downweight")
    served = await soft.pull(10)
    assert [t.loss_weight for t in served] == [1 / 3, 1 / 3]  # 2 versions past the bound
    assert soft.counters.downweighted == 2
    del stale


async def test_reject_records_the_error_and_keeps_it_out(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    await finished_group(turn_tree, run, 1)
    stream = _stream(turn_tree, run, group_size=1)
    (bad,) = await stream.pull(1)
    await stream.reject(bad.id, bad.lease_id, "token_ids and logprobs differ in length")
    (stored,) = await turn_tree.trajectories([bad.id])
    assert stored.status == "rejected"
    assert await stream.pull(1) == []


async def test_pull_waits_for_a_group_to_finish(turn_tree: TurnTree) -> None:
    run = await make_run(turn_tree)
    stream = _stream(turn_tree, run, group_size=1)
    puller = asyncio.create_task(stream.pull(5, timeout=10))
    await asyncio.sleep(0.1)
    assert not puller.done()
    await finished_group(turn_tree, run, 1)
    assert len(await asyncio.wait_for(puller, 5)) == 1
    with pytest.raises(InvalidInput):
        await stream.pull(0)


async def test_a_woken_pull_lingers_and_leases_what_came_meanwhile(turn_tree: TurnTree) -> None:
    """Woken by new trajectories, a waiting pull waits `linger_s` for more and takes them
    in one lease; the linger never runs past the pull's own timeout. (Polls, for other
    processes' trajectories, are out of the way here: a poll that finds some leases them.)"""
    run = await make_run(turn_tree)
    stream = _stream(turn_tree, run, group_size=1, poll_s=30, linger_s=2.0)
    puller = asyncio.create_task(stream.pull(5, timeout=30))
    await asyncio.sleep(0.1)
    first = await finished_group(turn_tree, run, 1)
    second = await finished_group(turn_tree, run, 1)  # within the linger
    assert {t.group_id for t in await asyncio.wait_for(puller, 10)} == {first, second}

    short = _stream(turn_tree, run, group_size=1, poll_s=30, linger_s=60.0)
    puller = asyncio.create_task(short.pull(5, timeout=0.5))
    await asyncio.sleep(0.1)
    third = await finished_group(turn_tree, run, 1)
    assert [t.group_id for t in await asyncio.wait_for(puller, 10)] == [third]


class _CountedLeases:
    """Counts a stream's lease transactions (each look at the database)."""

    def __init__(self, stream: DbTrajectoryStream) -> None:
        self.n = 0
        lease = stream._lease

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return await lease(*args, **kwargs)

        stream._lease = counted  # type: ignore[method-assign]


async def test_a_pull_for_min_n_keeps_what_it_leased_and_looks_again_when_enough_ended(
    turn_tree: TurnTree,
) -> None:
    """Short of `min_n`, a pull keeps its lease and looks again only once this process has
    made as many trajectories as it still needs (polls are out of the way here)."""
    run = await make_run(turn_tree)
    stream = _stream(turn_tree, run, group_size=1, poll_s=30, linger_s=0.0)
    leases = _CountedLeases(stream)
    first = await finished_group(turn_tree, run, 1)
    puller = asyncio.create_task(stream.pull(5, timeout=30, min_n=3))
    await asyncio.sleep(0.1)
    second = await finished_group(turn_tree, run, 1)  # one of the two it still needs
    await asyncio.sleep(0.2)
    assert not puller.done() and leases.n == 1
    third = await finished_group(turn_tree, run, 1)
    got = await asyncio.wait_for(puller, 10)
    assert [t.group_id for t in got] == [first, second, third] and leases.n == 2
    assert len({t.lease_id for t in got}) == 1
    assert await stream.ack([t.id for t in got], got[0].lease_id) == 3


async def test_a_pull_short_of_min_n_returns_what_it_has_at_its_timeout(
    turn_tree: TurnTree,
) -> None:
    run = await make_run(turn_tree)
    groups = [await finished_group(turn_tree, run, 1) for _ in range(2)]
    stream = _stream(turn_tree, run, group_size=1)
    got = await asyncio.wait_for(stream.pull(5, timeout=0.3, min_n=5), 10)
    assert [t.group_id for t in got] == groups
    for bad in (0, 6):
        with pytest.raises(InvalidInput) as caught:
            await stream.pull(5, min_n=bad)
        assert caught.value.field == ("min_n",)


async def test_min_n_counts_only_the_whole_groups_that_fit(turn_tree: TurnTree) -> None:
    """Groups of two in a pull of five: four is all a pull can take, so it waits for four,
    not for a fifth that would split a group."""
    run = await make_run(turn_tree)
    stream = _stream(turn_tree, run, group_size=2, poll_s=30, linger_s=0.0)
    puller = asyncio.create_task(stream.pull(5, timeout=30, min_n=5))
    await asyncio.sleep(0.1)
    groups = [await finished_group(turn_tree, run, 2) for _ in range(2)]
    got = await asyncio.wait_for(puller, 10)
    assert [t.group_id for t in got] == [g for g in groups for _ in range(2)]


async def test_concurrent_leasers_never_share_or_split_a_group(turn_tree: TurnTree) -> None:
    """Leasing locks only the rows it takes: leasers racing over the same groups each get
    whole groups, and no trajectory goes to two of them."""
    run = await make_run(turn_tree)
    groups = [await finished_group(turn_tree, run, 2) for _ in range(12)]
    streams = [_stream(turn_tree, run) for _ in range(4)]

    async def drain(stream: DbTrajectoryStream) -> list[Any]:
        got: list[Any] = []
        while batch := await stream.pull(4):
            got += batch
        return got

    served = await asyncio.gather(*(drain(s) for s in streams))
    ids = [t.id for batch in served for t in batch]
    assert len(ids) == len(set(ids)) == 2 * len(groups)
    for batch in served:
        per_group = Counter(t.group_id for t in batch)
        assert all(n == 2 for n in per_group.values())
