"""Play whole episodes of an env with a scripted policy (tests of envs and their servers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.base import Action, Env, Observation, StepResult

Policy = Callable[[Sequence[Observation]], Action]


@dataclass
class PlayedEpisode:
    """One finished episode: its actions, step results and total reward."""

    first: StepResult
    actions: list[Action] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return sum(r.reward for r in self.results)

    @property
    def success(self) -> bool:
        return bool(self.results and self.results[-1].info.get("success"))


async def play_episode(
    env: Env,
    policy: Policy,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    max_steps: int = 100,
    timeout_s: float | None = None,
) -> PlayedEpisode:
    """Reset ``env`` and step it with ``policy`` until the episode ends (or ``max_steps``)."""
    first = await env.reset(seed=seed, options=options)
    episode = PlayedEpisode(first=first)
    history = [first.observation]
    result = first
    while not result.done and len(episode.results) < max_steps:
        action = policy(history)
        result = await env.step(action, timeout_s=timeout_s)
        episode.actions.append(action)
        episode.results.append(result)
        history.append(result.observation)
    return episode
