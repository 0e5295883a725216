"""`TurnEnv`: the bookkeeping every turn-based env shares, so each env writes only its rules.

It enforces the protocol's edges in one place: step before reset or after the end raises
:class:`EpisodeFinished`, any call after close raises :class:`EnvClosed`, an action type
the env does not take raises :class:`InvalidAction`, a step past ``timeout_s`` raises
:class:`StepTimeout` (and ends the episode, whose state is then unknown), and the turn
budget truncates the episode.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from envs.base import (
    Action,
    EnvClosed,
    EpisodeFinished,
    InvalidAction,
    Observation,
    StepResult,
    StepTimeout,
    TextAction,
)


@dataclass
class Outcome:
    """What one turn produced; ``TurnEnv`` adds truncation and bookkeeping."""

    observation: Observation
    reward: float = 0.0
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


_UNSEEDED = random.Random(0)  # a TurnEnv's generator before its first reset


class TurnEnv(ABC):
    """Base class of the built-in envs: subclasses implement ``_start`` and ``_turn``."""

    env_id: str = "unregistered"
    accepted_actions: ClassVar[frozenset[str]] = frozenset({"text"})

    def __init__(self, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.max_turns = max_turns
        self.turns = 0
        self.seed: int | None = None
        # Replaced by `reset`'s seeded generator before any draw: one seeded from the
        # system's randomness here would cost more than the episode's other set-up.
        self.rng = _UNSEEDED
        self._started = False
        self._done = False
        self._closed = False
        self._last_reward = 0.0

    @abstractmethod
    async def _start(self, options: dict[str, Any]) -> Observation:
        """Draw a task from ``self.rng`` and answer the first observation."""

    @abstractmethod
    async def _turn(self, action: Action) -> Outcome:
        """Apply one action of an accepted type."""

    def _state(self) -> dict[str, Any]:
        """Env-specific part of ``state()``; never reveals the answer before the end."""
        return {}

    async def _release(self) -> None:
        """Free resources held across episodes (sandboxes, processes)."""
        return None

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        self._check_open()
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self.rng = random.Random(self.seed)
        self.turns = 0
        self._done = False
        self._last_reward = 0.0
        observation = await self._start(dict(options or {}))
        self._started = True
        return StepResult(observation=observation, info={"max_turns": self.max_turns})

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        self._check_open()
        if not self._started or self._done:
            raise EpisodeFinished("the episode has ended (or not started): call reset")
        if action.type not in self.accepted_actions:
            raise InvalidAction(
                f"{self.env_id} takes actions of type {sorted(self.accepted_actions)}, "
                f"not {action.type!r}"
            )
        self.turns += 1
        try:
            # A timeout in this task, not `wait_for`'s task per step (Python 3.11).
            async with asyncio.timeout(timeout_s):
                outcome = await self._turn(action)
        except TimeoutError:
            self._done = True
            raise StepTimeout(f"step did not finish within {timeout_s} s") from None
        except BaseException:
            self._done = True  # a half-applied turn leaves the episode in an unknown state
            raise
        truncated = not outcome.terminated and self.turns >= self.max_turns
        self._done = outcome.terminated or truncated
        self._last_reward = outcome.reward
        info = {"turn": self.turns, **outcome.info}
        return StepResult(
            observation=outcome.observation,
            reward=outcome.reward,
            terminated=outcome.terminated,
            truncated=truncated,
            info=info,
        )

    async def state(self) -> dict[str, Any]:
        self._check_open()
        return {
            "env": self.env_id,
            "seed": self.seed,
            "turn": self.turns,
            "max_turns": self.max_turns,
            "started": self._started,
            "done": self._done,
            **self._state(),
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._release()

    def _check_open(self) -> None:
        if self._closed:
            raise EnvClosed(f"{self.env_id} is closed")


_TEXT_TOOL_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.DOTALL)
_ANSWER_PREFIX = re.compile(r"answer\s*[:=]?", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+")


def text_tool_call(text: str, tool_names: set[str]) -> tuple[str, str] | None:
    """Read ``name(argument)`` as a call of a known tool with one string argument.

    Everything between the first ``(`` and the last ``)`` is the argument; one level of
    matching quotes around it is removed. Returns None for any other text.
    """
    match = _TEXT_TOOL_CALL.match(text)
    if match is None or match.group(1) not in tool_names:
        return None
    argument = match.group(2).strip()
    if len(argument) >= 2 and argument[0] == argument[-1] and argument[0] in "'\"":
        argument = argument[1:-1]
    return match.group(1), argument


def answer_part(text: str) -> str:
    """The text after the last ``answer`` marker (``answer:``, ``Answer =``), else all of it."""
    parts = _ANSWER_PREFIX.split(text)
    return parts[-1].strip()


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``"I guess 8"`` -> 8), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


TextPlayer = Callable[[Sequence[Observation]], TextAction]


def last_text(history: Sequence[Observation]) -> str:
    """What a scripted player reads: the newest observation's last message ("" before
    any)."""
    return history[-1].messages[-1].content if history and history[-1].messages else ""


def noisy_text_player(
    answer: Callable[[Sequence[Observation]], str],
    guess: Callable[[random.Random, Sequence[Observation]], str],
    p_oracle: float,
    seed: int | None = None,
) -> TextPlayer:
    """A warm start's imperfect scripted player: `answer(history)` with probability
    `p_oracle`, else `guess(rng, history)` (a well-formed wrong-or-lucky reply)."""
    if not 0.0 <= p_oracle <= 1.0:
        raise ValueError("p_oracle must be in [0, 1]")
    rng = random.Random(seed)

    def policy(history: Sequence[Observation]) -> TextAction:
        if rng.random() < p_oracle:
            return TextAction(text=answer(history))
        return TextAction(text=guess(rng, history))

    return policy
