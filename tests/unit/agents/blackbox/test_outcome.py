"""How a black-box agent's report becomes the episode's outcome (real lookup env)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from agentflow.agents.blackbox.live import AgentReport, LiveEpisodes
from agentflow.agents.blackbox.outcome import settle
from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import Conflict, NotFound
from agentflow.tokenization.chat import ByteChatTemplate
from envs.builtin.lookup import LookupEnv

RUNTIME = PolicyRuntime(engine=None, template=ByteChatTemplate())  # type: ignore[arg-type]


async def slot_with_env(live: LiveEpisodes) -> tuple[uuid.UUID, LookupEnv]:
    env = LookupEnv()
    await env.reset(seed=11)
    episode = uuid.uuid4()
    live.start_agent(episode, env, RUNTIME)
    return episode, env


async def test_env_judges_the_reported_answer() -> None:
    live = LiveEpisodes()
    episode, env = await slot_with_env(live)
    slot = live.agent(episode)
    right = await settle(slot, AgentReport("completed", answer=f"answer {env.answer}"), "env", 0)
    assert (right.status, right.reward) == ("completed", 1.0)

    episode, env = await slot_with_env(live)
    wrong = await settle(
        live.agent(episode), AgentReport("completed", answer="answer zebra"), "env", 0
    )
    assert (wrong.status, wrong.reward) == ("completed", 0.0)


async def test_no_answer_before_the_env_ends_is_truncated() -> None:
    live = LiveEpisodes()
    episode, _ = await slot_with_env(live)
    outcome = await settle(live.agent(episode), AgentReport("completed"), "env", 0)
    assert (outcome.status, outcome.reward) == ("truncated", 0.0)


async def test_agent_and_external_rewards() -> None:
    live = LiveEpisodes()
    episode, _ = await slot_with_env(live)
    slot = live.agent(episode)
    assert (await settle(slot, AgentReport("completed", reward=0.5), "agent", 0)).reward == 0.5
    missing = await settle(slot, AgentReport("completed"), "agent", 0)
    assert missing.status == "failed" and "no reward" in (missing.error or "")

    none_yet = await settle(slot, AgentReport("completed"), "external", time.monotonic())
    assert none_yet.status == "failed" and "deadline" in (none_yet.error or "")

    async def post_later() -> None:
        await asyncio.sleep(0.1)
        live.add_reward(episode, 0.75)

    poster = asyncio.create_task(post_later())
    later = await settle(slot, AgentReport("completed"), "external", time.monotonic() + 5)
    await poster
    assert (later.status, later.reward) == ("completed", 0.75)


async def test_failure_reports_and_registry_rules() -> None:
    live = LiveEpisodes()
    episode, env = await slot_with_env(live)
    failed = await settle(live.agent(episode), AgentReport("failed", error="crashed"), "env", 0)
    assert (failed.status, failed.error) == ("failed", "crashed")

    with pytest.raises(Conflict):
        live.start_agent(episode, env, RUNTIME)
    live.report(episode, AgentReport("completed"))
    with pytest.raises(Conflict):
        live.report(episode, AgentReport("completed"))  # only once
    await live.finish_agent(episode)
    assert episode not in live
    with pytest.raises(NotFound):
        live.add_reward(episode, 1.0)
