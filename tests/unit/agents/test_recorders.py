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
