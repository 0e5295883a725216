"""The white-box agent: the episode loop (`agentflow.agents.episode`) sampling from the
run's engine and recording into the turn tree, for one episode of a run.

The persisted context is, token for token, what the engine consumed and produced; an
episode's engine session is parked while a slow env works (`agentflow.agents.actions`).

RTPO re-rolls (`branches > 0`, `trainer.credit`): once the episode has ended, each chosen
policy turn after the first gets `branches` new continuations: a fresh env is brought to
the env turn before it by replaying the stored path (`EpisodeLoop.play(start=...)`), and
the loop samples on from there, recording beneath that env turn, so each continuation's
first reply is a sibling of the chosen turn. Every continuation is a leaf with its own
return (its path's rewards, the replayed ones included). A continuation that fails or is
aborted is left out of the episode's trajectories; the episode itself still counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from dataclasses import dataclass, field

from agentflow.agents.actions import SampledActions
from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.metrics import GatewayMetrics
from agentflow.types import StoredTurn

log = logging.getLogger(__name__)
TRAINABLE = ("completed", "truncated")


@dataclass
class WhiteBoxAgent:
    """Runs one episode in process. `park_after_s=None` never parks."""

    park_after_s: float | None = 5.0
    step_timeout_s: float | None = 60.0
    step_grace_s: float = 1.0  # beyond the env's own timeout, before the agent gives up
    system_prompt: str | None = None
    metrics: GatewayMetrics | None = None
    branches: int = 0  # RTPO: continuations re-rolled from each chosen policy turn
    branch_turns: int | None = None  # how many turns after the first (None: all of them)
    rng: random.Random = field(default_factory=random.Random)

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
        outcome = await loop.play(episode.env, episode.task, actions, recorder)
        if not self.branches or outcome.status not in TRAINABLE or recorder.last is None:
            return outcome
        return await self._re_roll(episode, loop, recorder.last, outcome)

    async def _re_roll(
        self,
        episode: EpisodeHandle,
        loop: EpisodeLoop,
        leaf: uuid.UUID,
        outcome: EpisodeOutcome,
    ) -> EpisodeOutcome:
        """The episode with its RTPO continuations (module docstring)."""
        if episode.env_factory is None:
            raise RuntimeError("re-rolls need the episode's env factory")
        path = await episode.turns.path(leaf)
        points = [i for i, turn in enumerate(path) if turn.kind == "policy"][1:]
        if self.branch_turns is not None and len(points) > self.branch_turns:
            points = sorted(self.rng.sample(points, self.branch_turns))
        starts = [path[:i] for i in points for _ in range(self.branches)]
        results = await asyncio.gather(*(self._continue(episode, loop, s) for s in starts))
        leaves = {path[-1].id: float(outcome.reward or 0.0)}
        for result in results:
            if result is not None:
                leaves[result[0]] = result[1]
        return EpisodeOutcome(
            outcome.status,
            outcome.reward,
            outcome.error,
            leaf_turn_ids=tuple(leaves),
            leaf_rewards=leaves,
            turns=outcome.turns,
            success=outcome.success,
        )

    async def _continue(
        self, episode: EpisodeHandle, loop: EpisodeLoop, start: list[StoredTurn]
    ) -> tuple[uuid.UUID, float] | None:
        """One continuation from the end of `start` (an env turn): (its leaf, its return),
        or None when it did not end in a trainable state."""
        assert episode.env_factory is not None
        env = episode.env_factory()
        recorder = TurnTreeRecorder(episode.turns, episode.episode_id, parent=start[-1].id)
        actions = SampledActions(
            episode.runtime, park_after_s=self.park_after_s, metrics=self.metrics
        )
        try:
            outcome = await loop.play(env, episode.task, actions, recorder, start=start)
        except Exception:  # noqa: BLE001 - a failed re-roll drops out; the episode stands
            log.warning("re-roll of episode %s failed", episode.episode_id, exc_info=True)
            return None
        finally:
            with contextlib.suppress(Exception):
                await env.close()
        if (
            outcome.status not in TRAINABLE
            or recorder.last is None
            or recorder.last == start[-1].id
        ):
            return None
        return recorder.last, float(outcome.reward or 0.0)
