"""White-box episodes on the real LocalEngine: the record is exactly what the engine saw."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.base import Budget, EpisodeHandle
from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.types import NewTurn, StoredTurn
from envs import registry
from tests.integration.agents.conftest import TINY
from tests.integration.rollout.scripted_envs import GatedEnv, SlowEnv

pytestmark = pytest.mark.integration


BUILTIN = sorted(e for e in registry.registered() if e.startswith("agentflow/"))


@pytest.mark.parametrize("env_id", BUILTIN)
async def test_persisted_tokens_are_what_the_engine_saw(
    env_id: str,
    runtime: PolicyRuntime,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    turns = TurnTree(sessions)
    episode_id = await turns.create_episode(env_ref=env_id, task={"seed": 3})
    env = registry.make(env_id)
    handle = EpisodeHandle(
        episode_id=episode_id,
        run_id=None,
        env=env,
        runtime=runtime,
        turns=turns,
        task={"seed": 3},
        budget=Budget(max_turns=3, max_tokens=1000),
    )
    try:
        outcome = await WhiteBoxAgent(park_after_s=None).run(handle)
    finally:
        await env.close()
    assert outcome.status in ("completed", "truncated"), outcome

    engine = runtime.engine
    assert len(engine.order) >= 1  # type: ignore[attr-defined]
    tree = await turns.episode_tree(episode_id)
    (root,) = tree.roots
    node, policy_turns = root, []
    while node.children:
        (node,) = node.children  # one path: the loop never branches
        if node.kind == "policy":
            policy_turns.append(node)
    assert len(policy_turns) == len(engine.order)  # type: ignore[attr-defined]
    for stored, rid in zip(policy_turns, engine.order, strict=True):  # type: ignore[attr-defined]
        result = engine.results[rid]  # type: ignore[attr-defined]
        context = await turns.context(stored.id)
        seen = engine.contexts[rid]  # type: ignore[attr-defined]
        assert list(context.token_ids) == seen + result.output_ids
        assert list(stored.token_ids) == result.output_ids
        assert stored.logprobs == pytest.approx(result.logprobs, abs=0, rel=1e-6)
        assert list(stored.weight_versions or ()) == result.token_versions()
        assert set(stored.timings) == {"queue", "generate"}


async def _play(
    runtime: PolicyRuntime, turns: TurnTree, park_after_s: float | None
) -> tuple[list[StoredTurn], list[StoredTurn]]:
    episode_id = await turns.create_episode(env_ref="test/Slow-v0")
    env = SlowEnv(delay=0.25, steps=3)
    handle = EpisodeHandle(
        episode_id=episode_id,
        run_id=None,
        env=env,
        runtime=runtime,
        turns=turns,
        budget=Budget(max_turns=3, max_tokens=1000),
    )
    outcome = await WhiteBoxAgent(park_after_s=park_after_s).run(handle)
    assert outcome.status == "completed" and outcome.reward == 1.0
    tree = await turns.episode_tree(episode_id)
    path, node = [], tree.roots[0]
    while node.children:
        (node,) = node.children
        path.append(node)
    return [t for t in path if t.kind == "policy"], [t for t in path if t.kind == "env"]


async def test_parked_session_resumes_with_the_right_context(
    runtime: PolicyRuntime, sessions: async_sessionmaker[AsyncSession]
) -> None:
    turns = TurnTree(sessions)
    engine = runtime.engine
    policy, env_turns = await _play(runtime, turns, park_after_s=0.02)
    rids = engine.order[-len(policy) :]  # type: ignore[attr-defined]
    for stored, rid in zip(policy, rids, strict=True):
        context = await turns.context(stored.id)
        # Parked: the KV was released, so each later turn recomputed its whole context.
        assert list(context.token_ids) == (
            engine.contexts[rid] + engine.results[rid].output_ids  # type: ignore[attr-defined]
        )
    later = [engine.results[rid] for rid in rids[1:]]  # type: ignore[attr-defined]
    assert later and all(r.cached_tokens == 0 for r in later)
    assert all(t.timings["parked"] > 0 for t in env_turns[:-1])

    # Not parked: the session's KV is reused for the next turn.
    await _play(runtime, turns, park_after_s=None)
    reused = [engine.results[rid] for rid in engine.order[-2:]]  # type: ignore[attr-defined]
    assert all(r.cached_tokens > 0 for r in reused)


async def test_sessions_waiting_on_their_env_hold_no_decode_slot(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """20 episodes wait on a blocked env while 4 others play to the end on an engine with
    only 4 decode slots: the waiting ones must not hold any."""
    engine = LocalEngine.from_init(TINY, seed=1, max_batch_size=4)
    runtime = PolicyRuntime(
        engine=engine,
        template=ByteChatTemplate(),
        sampling=SamplingParams(max_new_tokens=8),
        max_context=TINY.max_context,
    )
    turns = TurnTree(sessions)
    GatedEnv.gate, GatedEnv.waiting = asyncio.Event(), 0

    async def play(env: SlowEnv) -> str:
        episode_id = await turns.create_episode(env_ref="test")
        handle = EpisodeHandle(
            episode_id=episode_id,
            run_id=None,
            env=env,
            runtime=runtime,
            turns=turns,
            budget=Budget(max_turns=4, max_tokens=1000),
        )
        return (await WhiteBoxAgent(park_after_s=None).run(handle)).status

    try:
        blocked = [asyncio.create_task(play(GatedEnv(delay=0, steps=2))) for _ in range(20)]
        while GatedEnv.waiting < 20:  # every blocked episode is now waiting on its env
            await asyncio.sleep(0.01)
        fast = await asyncio.wait_for(
            asyncio.gather(*(play(SlowEnv(delay=0, steps=3)) for _ in range(4))), timeout=120
        )
        assert fast == ["completed"] * 4
        assert GatedEnv.waiting == 20  # they finished while all 20 still waited
        GatedEnv.gate.set()
        assert await asyncio.gather(*blocked) == ["completed"] * 20
    finally:
        GatedEnv.gate.set()
        await engine.close()


class _StallingClose:
    """An engine whose `close_session` waits (as on a lock held by a long step) until
    released, so a stop can land while an ending episode closes its session."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner = inner
        self.closing = asyncio.Event()
        self.release = asyncio.Event()

    async def close_session(self, session_id: str) -> None:
        self.closing.set()
        await self.release.wait()
        await self.inner.close_session(session_id)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _HeldTurns(TurnTree):
    """Records every queued turn's future; the write of the last env turn waits until
    `writes_open` is set, so the episode's end has a write in flight."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], env_steps: int) -> None:
        super().__init__(sessions)
        self.queued: list[asyncio.Future[None]] = []
        self.env_steps, self.env_turns = env_steps, 0
        self.writes_open = asyncio.Event()
        self.writes_open.set()

    def submit_turn(self, *args: Any) -> tuple[uuid.UUID, asyncio.Future[None]]:
        turn_id, committed = super().submit_turn(*args)
        self.queued.append(committed)
        return turn_id, committed

    async def _write_turns(self, batch: Sequence[NewTurn]) -> list[None]:
        self.env_turns += sum(t.record.kind == "env" for t in batch)
        if self.env_turns >= self.env_steps:
            await self.writes_open.wait()
        return await super()._write_turns(batch)


@pytest.mark.parametrize("stop_at", ["closing", "settling"])
async def test_a_stop_while_an_episode_ends_still_commits_its_turns(
    stop_at: str,
    local_engine: LocalEngine,
    sessions: async_sessionmaker[AsyncSession],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run records an episode's outcome once its agent task is over: every turn the
    agent queued must be committed by then, or it would land in (and be refused by) a
    finished episode. The stop lands while the agent closes its engine session, or while
    it waits for its last write."""
    engine = _StallingClose(local_engine)
    runtime = PolicyRuntime(
        engine=engine,  # type: ignore[arg-type]
        template=ByteChatTemplate(),
        sampling=SamplingParams(max_new_tokens=8),
        max_context=TINY.max_context,
    )
    turns = _HeldTurns(sessions, env_steps=2)
    settling = asyncio.Event()
    settle = TurnTreeRecorder.settle

    async def marked_settle(self: TurnTreeRecorder) -> None:
        settling.set()
        await settle(self)

    monkeypatch.setattr(TurnTreeRecorder, "settle", marked_settle)
    turns.writes_open.clear()  # the last env turn's write waits: the end has one in flight
    if stop_at == "settling":
        engine.release.set()
    episode_id = await turns.create_episode(env_ref="test/Slow-v0")
    handle = EpisodeHandle(
        episode_id=episode_id,
        run_id=None,
        env=SlowEnv(delay=0, steps=2),
        runtime=runtime,
        turns=turns,
        budget=Budget(max_turns=3, max_tokens=1000),
    )
    agent = asyncio.create_task(WhiteBoxAgent(park_after_s=None).run(handle))
    await (settling if stop_at == "settling" else engine.closing).wait()
    assert not agent.done()
    agent.cancel()
    engine.release.set()
    await asyncio.sleep(0.05)
    assert not agent.done()  # it waits for the held write, cancelled or not
    turns.writes_open.set()
    with pytest.raises(asyncio.CancelledError):
        await agent
    queued = turns.queued
    assert len(queued) == 5  # prompt, then policy and env turns twice
    assert all(f.done() and not f.cancelled() and f.exception() is None for f in queued)
    # The outcome is recorded now, as the run does; no turn may be left to write after it.
    await turns.complete_episode(episode_id, "aborted", error="run stopped")
    tree = await turns.episode_tree(episode_id)
    count, stack = 0, list(tree.roots)
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children)
    assert count == len(queued)
