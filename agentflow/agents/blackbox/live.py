"""`LiveEpisodes`: what this gateway process holds for black-box episodes while they run.

Per episode: the chat state (a lock that serialises matching against the turn tree, the
count of requests in flight for flood protection, the engine session and the policy
turns it holds), and, for episodes run by an `http` or `container` agent of this
process, the env the agent's tools act on and the completion the agent reports.

All of it is in memory: the turn tree in the database stays the source of truth, and a
restarted gateway rebuilds contexts from it (an engine session it lost is recomputed).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from agentflow.agents.base import Budget
from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import CapacityExceeded, Conflict, NotFound
from envs.base import Env

CompletionStatus = Literal["completed", "failed"]


class TooManyRequests(CapacityExceeded):
    """An episode has as many chat requests in flight as it may."""

    status_code = 429


class BudgetExhausted(Conflict):
    """The episode's turn or token budget is spent: it is recorded as truncated."""


@dataclass(frozen=True)
class AgentReport:
    """What an agent said when it finished (`POST /v1/episodes/{id}/complete`)."""

    status: CompletionStatus
    answer: str | None = None
    reward: float | None = None
    error: str | None = None


@dataclass
class ChatState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_flight: int = 0
    session_id: str | None = None
    engine: Any = None  # the engine the session lives on
    session_rids: set[uuid.UUID] = field(default_factory=set)  # policy turns it holds


@dataclass
class AgentSlot:
    """An episode an agent of this process is running: its env and how it ends."""

    env: Env
    runtime: PolicyRuntime
    report: asyncio.Future[AgentReport]
    rewards: list[float] = field(default_factory=list)  # from `POST .../reward`
    env_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    env_done: bool = False
    env_reward: float = 0.0  # sum of the env's step rewards
    budget: Budget | None = None
    budget_hit: str | None = None  # why a chat request was refused for the budget

    def check_budget(self, policy_turns: int, context_tokens: int) -> int | None:
        """Tokens the next answer may have (None: no limit); `BudgetExhausted` if none."""
        if self.budget is None:
            return None
        if policy_turns >= self.budget.max_turns:
            self.budget_hit = f"turn budget ({self.budget.max_turns}) reached"
        elif context_tokens >= self.budget.max_tokens:
            self.budget_hit = f"token budget ({self.budget.max_tokens}) reached"
        else:
            return self.budget.max_tokens - context_tokens
        raise BudgetExhausted(self.budget_hit)


class LiveEpisodes:
    def __init__(self, *, max_in_flight: int = 4) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self._chat: dict[uuid.UUID, ChatState] = {}
        self._agents: dict[uuid.UUID, AgentSlot] = {}

    # ---- chat ------------------------------------------------------------------------

    def chat(self, episode_id: uuid.UUID) -> ChatState:
        return self._chat.setdefault(episode_id, ChatState())

    @contextlib.contextmanager
    def admit(self, episode_id: uuid.UUID) -> Iterator[ChatState]:
        """Count one request in flight; `TooManyRequests` past the per-episode cap."""
        state = self.chat(episode_id)
        if state.in_flight >= self.max_in_flight:
            raise TooManyRequests(
                f"episode {episode_id} already has {state.in_flight} chat requests in "
                f"flight (at most {self.max_in_flight}); wait for one to finish"
            )
        state.in_flight += 1
        try:
            yield state
        finally:
            state.in_flight -= 1

    async def release_chat(self, episode_id: uuid.UUID) -> None:
        """Forget an episode's chat state and close its engine session."""
        state = self._chat.pop(episode_id, None)
        if state is not None and state.session_id is not None and state.engine is not None:
            with contextlib.suppress(Exception):  # the session may already be gone
                await state.engine.close_session(state.session_id)

    # ---- agents ----------------------------------------------------------------------

    def start_agent(
        self,
        episode_id: uuid.UUID,
        env: Env,
        runtime: PolicyRuntime,
        budget: Budget | None = None,
    ) -> AgentSlot:
        if episode_id in self._agents:
            raise Conflict(f"episode {episode_id} already has a running agent")
        slot = AgentSlot(
            env=env,
            runtime=runtime,
            report=asyncio.get_running_loop().create_future(),
            budget=budget,
        )
        self._agents[episode_id] = slot
        return slot

    def running(self, episode_id: uuid.UUID) -> AgentSlot | None:
        return self._agents.get(episode_id)

    def agent(self, episode_id: uuid.UUID) -> AgentSlot:
        slot = self._agents.get(episode_id)
        if slot is None:
            raise NotFound(
                f"episode {episode_id} is not run by a black-box agent of this gateway "
                "(unknown, finished, or run white-box)"
            )
        return slot

    def report(self, episode_id: uuid.UUID, report: AgentReport) -> None:
        slot = self.agent(episode_id)
        if slot.report.done():
            raise Conflict(f"episode {episode_id} has already reported its completion")
        slot.report.set_result(report)

    def add_reward(self, episode_id: uuid.UUID, reward: float) -> None:
        self.agent(episode_id).rewards.append(reward)

    async def finish_agent(self, episode_id: uuid.UUID) -> None:
        slot = self._agents.pop(episode_id, None)
        if slot is not None and not slot.report.done():
            slot.report.cancel()
        await self.release_chat(episode_id)

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self._agents
