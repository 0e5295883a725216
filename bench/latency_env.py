"""`agentflow/latency-model-v0`: an env that models an agent task's *timing*, for benchmarks.

Rollout scheduling is shaped by how long envs take and how many turns episodes last, not
by what the task is. This env reproduces those: each episode lasts a number of turns
drawn from the task seed (uniform in ``[min_turns, max_turns]``), each step waits a
long-tailed latency (lognormal with median ``latency_median_s`` and shape
``latency_sigma``, capped at ``latency_max_s``, also drawn from the seed) before answering
a short observation, and the last step pays a terminal reward.

The reward is 0 or 1, so a group of episodes of one task gets non-trivial advantages: the
task seed fixes a success probability (uniform in ``[0, 1]``: some tasks are easy, some
hard), and a coin seeded by the task seed *and* the agent's actions decides the episode,
so two samples of one task that answered differently may score differently, while the same
answers always score the same.

Every kwarg can be set from a run config (``[[envs]] kwargs``); ``time_scale`` multiplies
every latency so tests run the same schedule faster. Any action type is accepted (the
action's text, or its tool calls as JSON, feeds the reward coin).

It is a benchmark's simulator, not a built-in: :func:`register` adds it to the env
registry of the process that runs the benchmark.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from typing import Any, ClassVar

from envs import registry
from envs.base import Action, Message, Observation, TextAction, ToolCallsAction
from envs.turn_env import Outcome, TurnEnv

ENV_ID = "agentflow/latency-model-v0"


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


def _action_text(action: Action) -> str:
    if isinstance(action, TextAction):
        return action.text
    if isinstance(action, ToolCallsAction):
        return "".join(c.model_dump_json() for c in action.calls)
    return action.model_dump_json()


class LatencyModelEnv(TurnEnv):
    """A multi-turn episode with seeded turn count, step latencies and reward."""

    env_id = ENV_ID
    accepted_actions: ClassVar[frozenset[str]] = frozenset(
        {"text", "tool_calls", "browser", "computer"}
    )

    def __init__(
        self,
        min_turns: int = 2,
        max_turns: int = 6,
        latency_median_s: float = 0.5,
        latency_sigma: float = 1.0,
        latency_max_s: float = 10.0,
        time_scale: float = 1.0,
        observation_chars: int = 16,
    ) -> None:
        if not 1 <= min_turns <= max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if latency_median_s < 0 or latency_sigma < 0 or latency_max_s < 0:
            raise ValueError("latencies must be >= 0")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if observation_chars < 0:
            raise ValueError("observation_chars must be >= 0")
        super().__init__(max_turns=max_turns)
        self.min_turns = min_turns
        self.latency_median_s = latency_median_s
        self.latency_sigma = latency_sigma
        self.latency_max_s = latency_max_s
        self.time_scale = time_scale
        self.observation_chars = observation_chars
        self.episode_turns = min_turns
        self.success_p = 0.0
        self.latencies: list[float] = []  # wall seconds of each step, drawn at reset
        self._answers = hashlib.sha256()

    def draw_latency(self, rng: random.Random) -> float:
        """One step's latency in model seconds (before ``time_scale``)."""
        if self.latency_median_s == 0:
            return 0.0
        drawn = rng.lognormvariate(math.log(self.latency_median_s), self.latency_sigma)
        return min(self.latency_max_s, drawn)

    async def _start(self, options: dict[str, Any]) -> Observation:
        self.episode_turns = self.rng.randint(self.min_turns, self.max_turns)
        self.success_p = self.rng.random()
        self.latencies = [
            self.draw_latency(self.rng) * self.time_scale for _ in range(self.episode_turns)
        ]
        self._answers = hashlib.sha256(str(self.seed).encode())
        return _user(f"Task {self.seed}: {self.episode_turns} steps. Begin.")

    async def _turn(self, action: Action) -> Outcome:
        delay = self.latencies[self.turns - 1]
        if delay > 0:
            await asyncio.sleep(delay)
        self._answers.update(_action_text(action).encode())
        info: dict[str, Any] = {"latency_s": delay}
        if self.turns < self.episode_turns:
            filler = "x" * self.observation_chars
            return Outcome(_user(f"step {self.turns} ok {filler}"), info=info)
        coin = int.from_bytes(self._answers.digest()[:8], "little") / 2**64
        success = coin < self.success_p
        info["success"] = success
        return Outcome(_user("done"), reward=1.0 if success else 0.0, terminated=True, info=info)

    def _state(self) -> dict[str, Any]:
        return {"episode_turns": self.episode_turns}


def register() -> None:
    """Make ``registry.make(ENV_ID)`` (and run configs naming it) build this env."""
    registry.register(ENV_ID, LatencyModelEnv, replace=True)
