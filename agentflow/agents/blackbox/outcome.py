"""How a black-box episode starts and how its reward is decided.

Start: the gateway resets the env (`task["seed"]`, `task["options"]`) and hands the
agent the first observation's messages and the env's tool schemas; the agent acts on
the env through `POST /v1/episodes/{id}/env/step`.

Reward, by the agent kind's `reward` setting:

- `env` (default): the env's verifier. The reward is the sum of the env's step rewards;
  if the env has not ended when the agent reports, the reported `answer` is stepped as a
  text action first. An env that is still running after that makes the episode
  `truncated` (the agent stopped before the task ended, e.g. when the chat routes
  refused it for the episode's turn or token budget), else `completed`.
- `agent`: the `reward` in the agent's completion report (an agent that grades itself,
  e.g. by running a test suite); a report without one fails the episode.
- `external`: the last `POST /v1/episodes/{id}/reward` (by the agent or anyone holding
  the episode key or the API key), waited for until the deadline.

A `failed` report fails the episode with the agent's error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.blackbox.live import AgentReport, AgentSlot, LiveEpisodes
from envs.base import EnvError, TextAction

RewardSource = Literal["env", "agent", "external"]
REWARD_SOURCES: tuple[str, ...] = ("env", "agent", "external")


async def start_episode(
    live: LiveEpisodes, episode: EpisodeHandle
) -> tuple[AgentSlot, dict[str, object]]:
    """Reset the env, register the episode as live; the brief the agent receives."""
    task = episode.task
    seed = task.get("seed")
    options = task.get("options")
    first = await episode.env.reset(
        seed=seed if isinstance(seed, int) else None,
        options=options if isinstance(options, dict) else None,
    )
    slot = live.start_agent(episode.episode_id, episode.env, episode.runtime, episode.budget)
    base = episode.gateway_url.rstrip("/")
    episode_url = f"{base}/v1/episodes/{episode.episode_id}"
    brief: dict[str, object] = {
        "episode_id": str(episode.episode_id),
        "task": task,
        "messages": [m.model_dump(exclude_none=True) for m in first.observation.messages],
        "observation": first.observation.model_dump(mode="json", exclude_none=True),
        "tools": episode.env.tools(),
        "model": episode.runtime.model_name,
        "base_url": f"{base}/v1",
        "api_key": episode.api_key,
        "callback_url": f"{episode_url}/complete",
        "reward_url": f"{episode_url}/reward",
        "env_step_url": f"{episode_url}/env/step",
    }
    return slot, brief


async def settle(
    slot: AgentSlot, report: AgentReport, source: RewardSource, deadline: float
) -> EpisodeOutcome:
    """The outcome of an episode whose agent reported `report` (see the module docstring)."""
    if report.status == "failed":
        return EpisodeOutcome(status="failed", error=report.error or "the agent reported failure")
    if source == "agent":
        if report.reward is None:
            return EpisodeOutcome(status="failed", error="the agent reported no reward")
        return EpisodeOutcome(status="completed", reward=report.reward)
    if source == "external":
        while not slot.rewards and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not slot.rewards:
            return EpisodeOutcome(status="failed", error="no reward was posted before the deadline")
        return EpisodeOutcome(status="completed", reward=slot.rewards[-1])
    async with slot.env_lock:
        if not slot.env_done and report.answer is not None:
            try:
                result = await slot.env.step(TextAction(text=report.answer))
            except EnvError as exc:
                return EpisodeOutcome(
                    status="failed", error=f"the env could not judge the answer: {exc.message}"
                )
            slot.env_reward += result.reward
            slot.env_done = result.done
    if slot.env_done:
        return EpisodeOutcome(status="completed", reward=slot.env_reward)
    return EpisodeOutcome(
        status="truncated",
        reward=slot.env_reward,
        error=slot.budget_hit or "the agent stopped before the env ended",
    )
