"""Small envs for executor tests: slow, failing, and ones that count their concurrency."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from envs.base import Action, Message, Observation, StepResult, TextAction


class SlowEnv:
    """Answers every step after `delay` seconds; ends after `steps` steps with reward 1."""

    live: ClassVar[int] = 0
    peak: ClassVar[int] = 0

    def __init__(self, delay: float = 0.05, steps: int = 2) -> None:
        self.delay, self.steps, self.taken, self.closed = delay, steps, 0, False
        SlowEnv.live += 1
        SlowEnv.peak = max(SlowEnv.peak, SlowEnv.live)

    async def reset(self, seed: int | None = None, options: Any = None) -> StepResult:
        return StepResult(observation=Observation(messages=[Message(role="user", content="go")]))

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        await asyncio.sleep(self.delay)
        self.taken += 1
        done = self.taken >= self.steps
        reply = Message(role="user", content="again" if not done else "done")
        return StepResult(
            observation=Observation(messages=[reply]), reward=1.0 if done else 0.0, terminated=done
        )

    async def state(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            SlowEnv.live -= 1


class BrokenEnv(SlowEnv):
    """Raises inside step, as a buggy env would."""

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        raise RuntimeError("the env crashed")


class GatedEnv(SlowEnv):
    """Each step waits until `gate` opens: an env that is busy for as long as a test wants."""

    gate: ClassVar[asyncio.Event | None] = None
    waiting: ClassVar[int] = 0

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        assert GatedEnv.gate is not None
        GatedEnv.waiting += 1
        try:
            await GatedEnv.gate.wait()
        finally:
            GatedEnv.waiting -= 1
        return await super().step(action, timeout_s)


class HangingEnv(SlowEnv):
    """Never answers a step, whatever timeout it is given."""

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class ParityEnv(SlowEnv):
    """One step, rewarded 1 when the reply's UTF-8 length is even: about half of a random
    policy's samples score, so a group's rewards (and its advantages) almost never tie."""

    def __init__(self, delay: float = 0.0, steps: int = 1) -> None:
        super().__init__(delay=delay, steps=1)

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        text = action.text if isinstance(action, TextAction) else ""
        even = len(text.encode()) % 2 == 0
        return StepResult(
            observation=Observation(messages=[Message(role="user", content="done")]),
            reward=1.0 if even else 0.0,
            terminated=True,
        )
