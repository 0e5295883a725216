"""The agent boundary: whatever owns an episode's loop, white-box or black-box.

The run executor hands an `Agent` an `EpisodeHandle` (the persisted episode, its env and
the run's policy runtime) and gets an `EpisodeOutcome` back. The agent records turns as
they complete; the executor completes the episode (status, reward, trajectories) from the
outcome, so no agent kind can leave an episode half-finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.turn_tree import TurnTree
from envs.base import Env

OutcomeStatus = Literal["completed", "truncated", "failed", "aborted"]


@dataclass(frozen=True)
class Budget:
    """Hitting either records the episode as truncated, never silently cut."""

    max_turns: int = 8
    max_tokens: int = 1024


@dataclass
class EpisodeHandle:
    episode_id: uuid.UUID
    run_id: uuid.UUID | None
    env: Env
    runtime: PolicyRuntime
    turns: TurnTree
    task: dict[str, Any] = field(default_factory=dict)  # {seed, options, ...}
    budget: Budget = field(default_factory=Budget)
    gateway_url: str = ""  # where black-box agents reach the gateway; "" when not served
    api_key: str = ""  # the per-episode key for black-box agents
    step_timeout_s: float | None = None  # the env's own step timeout, when registered with one
    env_factory: Callable[[], Env] | None = None  # more of the same env (RTPO re-rolls)


@dataclass(frozen=True)
class EpisodeOutcome:
    status: OutcomeStatus
    reward: float | None = None
    error: str | None = None
    leaf_turn_ids: tuple[uuid.UUID, ...] | None = None  # None: every leaf of the tree
    leaf_rewards: dict[uuid.UUID, float] | None = None  # a leaf's own return (re-rolls)
    turns: int = 0  # env steps taken (white-box episodes)
    success: bool = False  # the env's `info["success"]` at the end (white-box episodes)


class Agent(Protocol):
    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome: ...
