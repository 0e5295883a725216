"""Real plug-ins for the plug-in tests, loaded by dotted path (`tests.support.plugins:...`)
once a test allows them with ``AGENTFLOW_PLUGIN_MODULES=tests.support``.

Each records what it saw in a module-level list, which the tests clear (`reset()`)."""

from __future__ import annotations

import uuid

from agentflow.agents.actions import ScriptedActions
from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.plugins import EpisodeEvent, RewardInput
from agentflow.run_config import AgentConfig
from envs.builtin.guess_number import oracle

AGENTS: list[GuessNumberOracleAgent] = []
REWARD_INPUTS: list[RewardInput] = []
EVENTS: list[EpisodeEvent] = []

NOT_CALLABLE = 3  # a plug-in path that names no function


def reset() -> None:
    for seen in (AGENTS, REWARD_INPUTS, EVENTS):
        seen.clear()


class GuessNumberOracleAgent:
    """A python agent: the one episode loop, with guess-number's binary search as the
    player (`ScriptedActions`) instead of the engine."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.played: list[uuid.UUID] = []

    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome:
        self.played.append(episode.episode_id)
        template = episode.runtime.template
        loop = EpisodeLoop(template, episode.budget, episode.runtime.max_context)
        recorder = TurnTreeRecorder(episode.turns, episode.episode_id)
        return await loop.play(
            episode.env, episode.task, ScriptedActions(template, oracle), recorder
        )


def guess_number_agent(config: AgentConfig) -> GuessNumberOracleAgent:
    agent = GuessNumberOracleAgent(config)
    AGENTS.append(agent)
    return agent


def not_an_agent(config: AgentConfig) -> object:
    return object()


def text_length(episode: RewardInput) -> float:
    """A sync reward function: the length of the episode's final text."""
    REWARD_INPUTS.append(episode)
    return float(len(episode.text))


async def doubled(episode: RewardInput) -> float:
    """An async reward function: twice the env's reward."""
    REWARD_INPUTS.append(episode)
    return 2 * (episode.env_reward or 0.0)


def failing_reward(episode: RewardInput) -> float:
    raise ValueError("no verdict for this one")


def nan_reward(episode: RewardInput) -> float:
    return float("nan")


async def record_event(event: EpisodeEvent) -> None:
    EVENTS.append(event)


def failing_hook(event: EpisodeEvent) -> None:
    raise RuntimeError("the hook broke")


def failing_rule(context: object) -> str | None:
    """A per-turn routing rule (`distill.rule`) with a bug."""
    raise RuntimeError("this rule always fails")
