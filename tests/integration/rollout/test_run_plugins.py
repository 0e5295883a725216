"""Plug-ins by dotted path in real runs (`agentflow.plugins`): a python agent, reward
functions and rollout hooks, on both databases, loaded from `tests.support.plugins`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.models import Episode, Run, Trajectory
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import SamplingParams
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.executor import RunExecutor
from agentflow.run_config import RunConfig
from agentflow.tokenization.chat import ByteChatTemplate
from envs import registry
from tests.integration.rollout.scripted_envs import SlowEnv
from tests.support import plugins
from tests.support.engine import MockEngine

pytestmark = pytest.mark.integration

PLUGINS = "tests.support.plugins"


@pytest.fixture(autouse=True)
def allow_test_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "tests.support")
    registry.register("test/Slow-v0", SlowEnv, replace=True)
    plugins.reset()
    yield
    registry.unregister("test/Slow-v0")
    plugins.reset()


def _config(reward: str | None, hooks: tuple[str, ...] = ()) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "plugins-test",
            "envs": [{"id": "test/Slow-v0", "reward": reward}],
            "rollout": {
                "group_size": 2,
                "max_episodes": 4,
                "wait_for_trainer": False,
                "hooks": list(hooks),
            },
        }
    )


@pytest.fixture
async def run_plugins(turn_tree: TurnTree) -> AsyncIterator[Callable[..., Any]]:
    """Play `config` to the end with a white-box agent on a fake engine; the executor."""
    made: list[RunExecutor] = []

    async def run(config: RunConfig) -> RunExecutor:
        async with turn_tree.sessions.begin() as session:
            row = Run(name=config.name, config=config.model_dump(mode="json"), status="pending")
            session.add(row)
            await session.flush()
            run_id = row.id
        template = ByteChatTemplate()
        runtime = PolicyRuntime(
            MockEngine(),  # answers "7"
            template,
            sampling=SamplingParams(max_new_tokens=4, stop_token_ids=template.stop_ids),
        )
        source = EnvSource(
            "test/Slow-v0", 1.0, 64, step_timeout_s=None, kwargs={"delay": 0.0, "steps": 2}
        )
        executor = RunExecutor(
            run_id,
            config,
            turns=turn_tree,
            runtime=runtime,
            sources=[source],
            agent=WhiteBoxAgent(park_after_s=None),
            gateway_url="http://unused",
            secret_key="k",
        )
        made.append(executor)
        await executor.start()
        async with asyncio.timeout(30):
            await executor.wait()
        return executor

    yield run
    for executor in made:
        await executor.stop()


async def _episodes(turns: TurnTree, run_id: uuid.UUID) -> list[Episode]:
    async with turns.sessions() as session:
        return list(await session.scalars(select(Episode).where(Episode.run_id == run_id)))


async def _trajectory_rewards(turns: TurnTree, episode_id: uuid.UUID) -> list[float | None]:
    async with turns.sessions() as session:
        query = select(Trajectory.reward).where(Trajectory.episode_id == episode_id)
        return list(await session.scalars(query))


async def _final_text(turns: TurnTree, episode_id: uuid.UUID) -> str:
    (leaf,) = await turns.leaves(episode_id)
    return ByteChatTemplate().tokenizer.decode((await turns.context(leaf.id)).token_ids)


@pytest.mark.parametrize("reward_fn", ["text_length", "doubled"])
async def test_a_reward_function_sets_the_episode_and_trajectory_reward(
    run_plugins: Any, turn_tree: TurnTree, reward_fn: str
) -> None:
    executor = await run_plugins(_config(f"{PLUGINS}:{reward_fn}"))
    assert executor.state == "finished"
    episodes = await _episodes(turn_tree, executor.run_id)
    assert [e.status for e in episodes] == ["completed"] * 4
    for episode in episodes:
        text = await _final_text(turn_tree, episode.id)
        assert "go" in text and "7" in text and "done" in text  # prompt, reply, env's end
        expected = float(len(text)) if reward_fn == "text_length" else 2.0  # env reward 1
        assert episode.reward == expected
        assert await _trajectory_rewards(turn_tree, episode.id) == [expected]
    seen = sorted(plugins.REWARD_INPUTS, key=lambda r: str(r.episode_id))
    assert [r.episode_id for r in seen] == sorted((e.id for e in episodes), key=str)
    for given in seen:
        assert (given.run_id, given.env, given.status) == (
            executor.run_id,
            "test/Slow-v0",
            "completed",
        )
        assert given.env_reward == 1.0 and isinstance(given.task["seed"], int)
        assert given.texts == (await _final_text(turn_tree, given.episode_id),)


@pytest.mark.parametrize(
    ("reward_fn", "error"),
    [
        ("failing_reward", "ValueError: no verdict for this one"),
        ("nan_reward", "ValueError: returned nan, not a finite number"),
    ],
)
async def test_a_failing_reward_function_fails_its_episodes_not_the_run(
    run_plugins: Any, turn_tree: TurnTree, reward_fn: str, error: str
) -> None:
    executor = await run_plugins(_config(f"{PLUGINS}:{reward_fn}"))
    assert executor.state == "finished"  # the run went on to max_episodes
    episodes = await _episodes(turn_tree, executor.run_id)
    assert [(e.status, e.reward) for e in episodes] == [("failed", None)] * 4
    assert {e.error for e in episodes} == {f"reward function {PLUGINS}:{reward_fn}: {error}"}
    for episode in episodes:
        assert await _trajectory_rewards(turn_tree, episode.id) == []


async def test_hooks_see_every_episode_once_and_a_raising_hook_is_harmless(
    run_plugins: Any, turn_tree: TurnTree
) -> None:
    hooks = (f"{PLUGINS}:failing_hook", f"{PLUGINS}:record_event")
    executor = await run_plugins(_config(f"{PLUGINS}:failing_reward", hooks))
    assert executor.state == "finished"
    assert executor.counters.hook_errors == 4  # once per episode, and counted
    episodes = {e.id: e for e in await _episodes(turn_tree, executor.run_id)}
    events = plugins.EVENTS
    assert sorted(e.episode_id for e in events) == sorted(episodes)  # each exactly once
    for event in events:
        stored = episodes[event.episode_id]
        assert (event.run_id, event.env) == (executor.run_id, "test/Slow-v0")
        assert (event.status, event.reward, event.error) == (
            stored.status,
            stored.reward,
            stored.error,
        )
        assert event.trajectories == 0  # failed by the reward function: nothing to train


async def test_hooks_count_the_trajectories_made(run_plugins: Any) -> None:
    executor = await run_plugins(_config(None, (f"{PLUGINS}:record_event",)))
    assert executor.counters.hook_errors == 0
    assert [(e.status, e.reward, e.trajectories) for e in plugins.EVENTS] == [
        ("completed", 1.0, 1)
    ] * 4


# ---- a python agent, through the gateway ------------------------------------------------


@pytest.fixture
async def api(database_url: str) -> AsyncIterator[AsyncClient]:
    app = create_app(Settings(database_url=database_url))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            yield client


async def test_a_python_agent_plays_the_runs_episodes(api: AsyncClient) -> None:
    run = await api.create_run(
        {
            "name": f"python-agent-{uuid.uuid4().hex[:6]}",
            "model": {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 512}},
            "envs": [{"id": "agentflow/guess-number-v0"}],
            "agent": {"type": "python", "entry_point": f"{PLUGINS}:guess_number_agent"},
            "rollout": {"group_size": 2, "max_episodes": 4, "hooks": [f"{PLUGINS}:record_event"]},
        }
    )
    async with asyncio.timeout(60):
        while (await api.get_run(run.id)).status != "finished":
            await asyncio.sleep(0.05)
    (agent,) = plugins.AGENTS  # the factory was called once, for the run
    assert agent.config.type == "python" and agent.config.max_turns == 6
    episodes = (await api.list_run_episodes(run.id)).items
    assert sorted(agent.played) == sorted(e.id for e in episodes) and len(episodes) == 4
    # The oracle's binary search always finds the number, which a tiny random model cannot.
    assert all(e.status == "completed" and (e.reward or 0) > 0.5 for e in episodes)
    tree = await api.get_episode(episodes[0].id)
    assert tree["roots"][0]["kind"] == "prompt" and tree["trajectories"]
    assert sorted(e.episode_id for e in plugins.EVENTS) == sorted(agent.played)
