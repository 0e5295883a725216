"""The episode loop continues a stored episode from any of its turns, as a branch."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.actions import ScriptedActions
from agentflow.agents.base import Budget
from agentflow.agents.episode import EpisodeLoop, ReplayMismatch
from agentflow.agents.recorders import MemoryRecorder, TurnTreeRecorder
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import EnvTimeout
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.types import StoredTurn, TurnRecord
from envs import registry
from envs.base import Action, Message, Observation, StepResult, StepTimeout, TextAction
from envs.turn_env import Outcome, TurnEnv

pytestmark = pytest.mark.integration

GUESS = "agentflow/guess-number-v0"
TASK = {"seed": 7}  # the hidden number is 11: counting up from 1 never finds it in 5 turns


def count_up(history: Sequence[Observation]) -> TextAction:
    return TextAction(text=str(len(history)))  # 1, 2, 3, ...


def knows_it(history: Sequence[Observation]) -> TextAction:
    return TextAction(text="11")


class _Both:
    """Records into two recorders at once."""

    def __init__(self, *recorders: TurnTreeRecorder | MemoryRecorder) -> None:
        self.recorders = recorders

    async def record(self, record: TurnRecord) -> None:
        for recorder in self.recorders:
            await recorder.record(record)

    async def settle(self) -> None:
        for recorder in self.recorders:
            await recorder.settle()


def _loop() -> EpisodeLoop:
    return EpisodeLoop(ByteChatTemplate(), Budget(max_turns=5, max_tokens=1024))


async def _stored_episode(turns: TurnTree) -> tuple[uuid.UUID, list[StoredTurn]]:
    episode_id = await turns.create_episode(env_ref=GUESS, task=TASK)
    env = registry.make(GUESS)
    loop = _loop()
    try:
        outcome = await loop.play(
            env, TASK, ScriptedActions(loop.template, count_up), TurnTreeRecorder(turns, episode_id)
        )
    finally:
        await env.close()
    assert outcome.status == "truncated" and outcome.turns == 5
    (leaf,) = await turns.leaves(episode_id)
    return episode_id, await turns.path(leaf.id)


@pytest.mark.parametrize("cut", [0, 1, 2, 5], ids=["prompt", "reply", "answer", "third-reply"])
async def test_a_stored_episode_continues_from_any_turn_as_a_branch(
    cut: int, sessions: async_sessionmaker[AsyncSession]
) -> None:
    turns = TurnTree(sessions)
    episode_id, path = await _stored_episode(turns)
    start = path[: cut + 1]
    env = registry.make(GUESS)
    loop = _loop()
    memory = MemoryRecorder(start)
    branch = TurnTreeRecorder(turns, episode_id, parent=start[-1].id)
    try:
        outcome = await loop.play(
            env, TASK, ScriptedActions(loop.template, knows_it), _Both(branch, memory), start=start
        )
    finally:
        await env.close()

    # The replayed guesses count toward the turns; the branch then finds 11.
    replayed = sum(t.kind == "policy" for t in start)
    assert outcome.status == "completed" and outcome.success
    assert outcome.turns > replayed
    leaves = await turns.leaves(episode_id)
    assert len(leaves) == 2  # the stored episode, and the branch beside it
    new_leaf = next(leaf for leaf in leaves if leaf.id != path[-1].id)
    new_path = await turns.path(new_leaf.id)
    assert [t.id for t in new_path[: len(start)]] == [t.id for t in start]
    context = await turns.context(new_leaf.id)
    assert list(context.token_ids) == memory.token_ids  # the branch's whole context
    assert list(context.loss_mask) == memory.loss_mask
    made = await turns.complete_episode(episode_id, "completed", outcome.reward)
    assert len(made) == 2


async def test_an_env_that_answers_the_replay_differently_is_refused(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    turns = TurnTree(sessions)
    _, path = await _stored_episode(turns)
    env = registry.make(GUESS)
    loop = _loop()
    try:
        with pytest.raises(ReplayMismatch, match="differently"):
            # Hidden number 2: the replayed guess 1 is answered "higher" as before, guess 2
            # is now correct instead of "higher".
            await loop.play(
                env,
                {"seed": 2},
                ScriptedActions(loop.template, count_up),
                MemoryRecorder(),
                start=path[:5],
            )
    finally:
        await env.close()


@pytest.mark.parametrize(
    "env_id",
    ["agentflow/long-vault-v0", "agentflow/slip-vault-v0", "agentflow/recall-vault-v0"],
)
async def test_the_credit_study_envs_replay_their_luck_for_a_re_roll(
    env_id: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """RTPO re-rolls these envs from every dial turn: the replay meets the stored noise,
    slips and jams (drawn from the seed and the replies), so no branch is refused."""
    turns = TurnTree(sessions)
    task = {"seed": 11}
    episode_id = await turns.create_episode(env_ref=env_id, task=task)
    noisy = registry.noisy_oracle_factory(env_id)
    assert noisy is not None
    loop = EpisodeLoop(ByteChatTemplate(), Budget(max_turns=8, max_tokens=1024))
    env = registry.make(env_id)
    try:
        outcome = await loop.play(
            env,
            task,
            ScriptedActions(loop.template, noisy(0.5, 3)),
            TurnTreeRecorder(turns, episode_id),
        )
        (leaf,) = await turns.leaves(episode_id)
        path = await turns.path(leaf.id)
        replies = [i for i, t in enumerate(path) if t.kind == "policy"]
        assert len(replies) == outcome.turns >= 3
        seen = {leaf.id}
        for cut in replies[1:]:
            start = path[: cut + 1]
            branch = await loop.play(
                env,
                task,
                ScriptedActions(loop.template, registry.oracle(env_id)),
                TurnTreeRecorder(turns, episode_id, parent=start[-1].id),
                start=start,
            )
            assert branch.status == "completed"
            (new_leaf,) = [x for x in await turns.leaves(episode_id) if x.id not in seen]
            seen.add(new_leaf.id)
            # The branch's return, replayed turns included, is what its stored path paid:
            # the stored turns before the cut and the new ones after it.
            new_path = await turns.path(new_leaf.id)
            assert [t.id for t in new_path[: cut + 1]] == [t.id for t in start]
            paid = sum(t.reward or 0.0 for t in new_path if t.kind == "env")
            assert branch.reward == pytest.approx(paid)
    finally:
        await env.close()
    assert len(seen) == len(replies)


class _SlowTurns(TurnEnv):
    """A `TurnEnv` whose every step takes a second."""

    async def _start(self, options: dict[str, object]) -> Observation:
        return Observation(messages=[Message(role="user", content="go")])

    async def _turn(self, action: Action) -> Outcome:
        await asyncio.sleep(1.0)
        raise AssertionError("unreachable: the step's timeout ends it first")


class _SlowWrapped(_SlowTurns):
    """The same env with a `step` of its own, which the loop holds to the timeout."""

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        await asyncio.sleep(1.0)
        raise AssertionError("unreachable: the loop's guard ends it first")


@pytest.mark.parametrize(("env", "error"), [(_SlowTurns, StepTimeout), (_SlowWrapped, EnvTimeout)])
async def test_a_step_past_its_timeout_fails_the_episode(
    env: type[TurnEnv], error: type[Exception]
) -> None:
    """`TurnEnv.step` holds itself to the step timeout (the loop adds no timer of its own
    around it); any other env's step is held to it by the loop, with its grace."""
    loop = EpisodeLoop(ByteChatTemplate(), step_timeout_s=0.05, step_grace_s=0.05)
    started = time.perf_counter()
    with pytest.raises(error):
        await loop.play(
            env(max_turns=3), {}, ScriptedActions(loop.template, count_up), MemoryRecorder()
        )
    assert time.perf_counter() - started < 0.9
