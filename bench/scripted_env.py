"""The env the gateway benchmarks drive: a fixed reply after `delay` seconds per step."""

from __future__ import annotations

import asyncio
from typing import Any

from envs.base import Action, Message, Observation, StepResult


class DelayEnv:
    """Answers every action with one short message after `delay` s; ends after `steps`."""

    def __init__(self, delay: float, steps: int) -> None:
        self.delay, self.steps, self.taken = delay, steps, 0

    async def reset(self, seed: int | None = None, options: Any = None) -> StepResult:
        self.taken = 0
        return StepResult(observation=Observation(messages=[Message(role="user", content="go")]))

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        if self.delay:
            await asyncio.sleep(self.delay)
        self.taken += 1
        done = self.taken >= self.steps
        reply = Message(role="user", content="lower")
        return StepResult(observation=Observation(messages=[reply]), terminated=done, reward=1.0)

    async def state(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        return None
