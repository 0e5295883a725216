"""The white-box agent: the episode loop (`agentflow.agents.episode`) sampling from the
run's engine and recording into the turn tree, for one episode of a run.

The persisted context is, token for token, what the engine consumed and produced; an
episode's engine session is parked while a slow env works (`agentflow.agents.actions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentflow.agents.actions import SampledActions
from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.metrics import GatewayMetrics


@dataclass
class WhiteBoxAgent:
    """Runs one episode in process. `park_after_s=None` never parks."""

    park_after_s: float | None = 5.0
    step_timeout_s: float | None = 60.0
    step_grace_s: float = 1.0  # beyond the env's own timeout, before the agent gives up
    system_prompt: str | None = None
    metrics: GatewayMetrics | None = None

    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome:
        runtime = episode.runtime
        loop = EpisodeLoop(
            runtime.template,
            episode.budget,
            runtime.max_context,
            system_prompt=self.system_prompt,
            step_timeout_s=episode.step_timeout_s or self.step_timeout_s,
            step_grace_s=self.step_grace_s,
            metrics=self.metrics,
        )
        actions = SampledActions(runtime, park_after_s=self.park_after_s, metrics=self.metrics)
        recorder = TurnTreeRecorder(episode.turns, episode.episode_id)
        return await loop.play(episode.env, episode.task, actions, recorder)
