"""`TurnTreeRecorder` around a stand-in turn store: a reply's turn goes with the env's
answer to it, or alone once `hold_s` has passed; every turn is queued in order."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.types import TurnRecord


class QueuedTurns:
    """Records each submitted turn and when; every write commits at once."""

    def __init__(self) -> None:
        self.submitted: list[tuple[float, uuid.UUID | None, str]] = []
        self.forced = 0  # how often the recorder said it waits on its writes, come what may

    @property
    def turns_queued(self) -> int:
        return 0  # every write commits at once: nothing waits for a batch

    def hurry_turns(self, *, at_most: int | None = None) -> None:
        self.forced += at_most is None
        self.at_most = at_most

    def submit_turn(
        self, episode_id: uuid.UUID, parent_id: uuid.UUID | None, record: TurnRecord
    ) -> tuple[uuid.UUID, asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        self.submitted.append((loop.time(), parent_id, record.kind))
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return uuid.uuid4(), done


def recorder(turns: QueuedTurns, **kwargs: Any) -> TurnTreeRecorder:
    return TurnTreeRecorder(turns, uuid.uuid4(), **kwargs)  # type: ignore[arg-type]


POLICY = TurnRecord(kind="policy", token_ids=(1,), logprobs=(-0.1,), weight_versions=(0,))
ENV = TurnRecord(kind="env", token_ids=(2,))


async def test_a_reply_is_queued_with_the_env_answer_to_it() -> None:
    turns = QueuedTurns()
    rec = recorder(turns, hold_s=10)
    await rec.record(TurnRecord(kind="prompt", token_ids=(0,)))
    await rec.record(POLICY)
    assert [kind for _, _, kind in turns.submitted] == ["prompt"]  # held
    await rec.record(ENV)
    times = [t for t, _, _ in turns.submitted]
    assert [kind for _, _, kind in turns.submitted] == ["prompt", "policy", "env"]
    assert times[2] - times[1] < 0.01  # queued together, with no wait between
    # Each turn's parent is the one before it.
    await rec.settle()
    assert turns.submitted[1][1] is not None and turns.submitted[2][1] is not None
    assert turns.submitted[1][1] != turns.submitted[2][1]


async def test_a_slow_env_does_not_keep_the_reply_unqueued() -> None:
    turns = QueuedTurns()
    rec = recorder(turns, hold_s=0.05)
    await rec.record(POLICY)
    await asyncio.sleep(0.2)  # the env takes longer than hold_s
    assert [kind for _, _, kind in turns.submitted] == ["policy"]
    await rec.record(ENV)
    assert [kind for _, _, kind in turns.submitted] == ["policy", "env"]


async def test_settle_queues_a_held_reply() -> None:
    turns = QueuedTurns()
    rec = recorder(turns, hold_s=10)
    await rec.record(POLICY)  # the episode ends on a reply (an abort, a budget)
    await rec.settle()
    assert [kind for _, _, kind in turns.submitted] == ["policy"]
    assert rec.last is not None


class GatheringTurns(QueuedTurns):
    """Writes wait `gather_s` (as gathering writes do), or until the recorder says it
    waits on them."""

    gather_s = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.unwritten: list[asyncio.Future[None]] = []

    def submit_turn(
        self, episode_id: uuid.UUID, parent_id: uuid.UUID | None, record: TurnRecord
    ) -> tuple[uuid.UUID, asyncio.Future[None]]:
        self.submitted.append((0.0, parent_id, record.kind))
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        self.unwritten.append(written)
        loop.call_later(self.gather_s, self._write, written)
        return uuid.uuid4(), written

    def _write(self, written: asyncio.Future[None]) -> None:
        if not written.done():
            written.set_result(None)

    queued_by_others = 0

    @property
    def turns_queued(self) -> int:
        return len(self.unwritten) + self.queued_by_others

    def hurry_turns(self, *, at_most: int | None = None) -> None:
        super().hurry_turns(at_most=at_most)
        if at_most is not None and len(self.unwritten) + self.queued_by_others > at_most:
            return
        for written in self.unwritten:
            self._write(written)
        self.unwritten.clear()


async def test_a_full_window_hurries_the_writes_it_waits_on() -> None:
    """A full window would stall the loop for the gathering: it hurries the writes. The
    episode's end hurries them only if they are all that is queued; among other
    episodes' writes it waits for them to gather (one batch per end would undo it)."""
    turns = GatheringTurns()
    turns.queued_by_others = 5
    rec = recorder(turns, window=2)
    loop = asyncio.get_running_loop()
    await rec.record(ENV)
    await rec.record(ENV)
    # Two writes outstanding among others' writes: the loop goes on, they keep gathering.
    assert len(turns.unwritten) == 2 and turns.forced == 0
    started = loop.time()
    await asyncio.wait_for(rec.record(ENV), 5)  # the window is full: it waits, hurried
    assert turns.forced == 1 and loop.time() - started < turns.gather_s
    started = loop.time()
    await asyncio.wait_for(rec.settle(), 5)
    assert loop.time() - started >= turns.gather_s * 0.9  # others' writes queued
    assert turns.at_most == 1  # its own write: the one the window did not hurry

    alone = GatheringTurns()
    rec = recorder(alone)
    await rec.record(ENV)
    started = loop.time()
    await asyncio.wait_for(rec.settle(), 5)
    assert loop.time() - started < alone.gather_s  # nothing else queued: hurried


async def test_half_a_window_alone_is_written_while_the_episode_goes_on() -> None:
    """A fast episode alone: once half its window is outstanding, its writes go at once,
    so its next turns overlap the write instead of waiting on a full window. Among other
    episodes' writes they keep gathering."""
    alone = GatheringTurns()
    rec = recorder(alone, window=4)
    await rec.record(ENV)
    assert len(alone.unwritten) == 1  # gathering
    await rec.record(ENV)  # half the window: written now, and the loop did not wait
    assert not alone.unwritten and all(write.done() for write in rec.pending)
    assert alone.forced == 0

    among_others = GatheringTurns()
    among_others.queued_by_others = 3
    rec = recorder(among_others, window=4)
    await rec.record(ENV)
    await rec.record(ENV)
    assert len(among_others.unwritten) == 2 and among_others.at_most == 2


async def test_among_other_episodes_writes_the_small_window_holds() -> None:
    """A writer that falls behind holds every episode to `shared_window` unwritten
    writes, not its whole window: the queue stays a few turns per episode."""
    turns = GatheringTurns()
    turns.queued_by_others = 100
    rec = recorder(turns, window=16, shared_window=4)
    loop = asyncio.get_running_loop()
    for _ in range(4):
        await rec.record(ENV)
    assert turns.forced == 0 and len(turns.unwritten) == 4
    started = loop.time()
    await asyncio.wait_for(rec.record(ENV), 5)  # the fifth waits on the oldest, hurried
    assert turns.forced == 1 and loop.time() - started < turns.gather_s

    alone = GatheringTurns()
    rec = recorder(alone, window=16, shared_window=4)
    for _ in range(8):
        await rec.record(ENV)
    assert alone.forced == 0  # alone: half the window went at once, nobody waited


class FailingTurns(QueuedTurns):
    """The first write fails at once; the others commit `delay_s` later."""

    delay_s = 0.1

    def submit_turn(
        self, episode_id: uuid.UUID, parent_id: uuid.UUID | None, record: TurnRecord
    ) -> tuple[uuid.UUID, asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        if not self.submitted:
            written.set_exception(ValueError("refused"))
        else:
            loop.call_later(self.delay_s, written.set_result, None)
        self.submitted.append((loop.time(), parent_id, record.kind))
        return uuid.uuid4(), written


async def test_settle_waits_for_every_write_then_raises_the_first_failure() -> None:
    turns = FailingTurns()
    rec = recorder(turns, hold_s=0)
    for _ in range(2):  # the first failed already, the second commits later
        rec.pending.append(turns.submit_turn(rec.episode_id, None, ENV)[1])
    later = rec.pending[-1]
    try:
        await asyncio.wait_for(rec.settle(), 5)
    except ValueError as exc:
        assert str(exc) == "refused"
    else:
        raise AssertionError("the failed write was not raised")
    assert later.done()  # raised only once the write after it was settled too
