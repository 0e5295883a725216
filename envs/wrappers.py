"""Wrappers that add behaviour around any env without the env knowing."""

from __future__ import annotations

from typing import Any

from envs.base import Action, Env, EpisodeFinished, StepResult


class TimeLimit:
    """Truncate an episode after ``max_episode_steps`` steps (Gymnasium's `TimeLimit`)."""

    def __init__(self, env: Env, max_episode_steps: int) -> None:
        if max_episode_steps < 1:
            raise ValueError("max_episode_steps must be >= 1")
        self.env = env
        self.max_episode_steps = max_episode_steps
        self._steps = 0
        self._done = False

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        result = await self.env.reset(seed=seed, options=options)
        self._steps, self._done = 0, result.done
        return result

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        if self._done:
            raise EpisodeFinished("the episode has ended: call reset")
        result = await self.env.step(action, timeout_s=timeout_s)
        self._steps += 1
        if not result.done and self._steps >= self.max_episode_steps:
            result = result.model_copy(update={"truncated": True})
        self._done = result.done
        return result

    async def state(self) -> dict[str, Any]:
        return {**await self.env.state(), "time_limit": self.max_episode_steps}

    def tools(self) -> list[dict[str, Any]]:
        return self.env.tools()

    async def close(self) -> None:
        await self.env.close()
