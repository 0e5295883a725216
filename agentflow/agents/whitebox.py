"""The white-box agent: the token-level loop of DESIGN §5, on any Engine and any Env.

Per episode: render the prompt (task messages + tool schemas) with the run's chat
template and persist it; then repeatedly generate only the new tokens (the engine session
keeps the prefix), persist the policy turn with the engine's token ids, log-probs and
weight versions, turn the output into an action, step the env, and append the
observation as a token delta. Nothing is re-tokenized: the persisted context is, token
for token, what the engine consumed and produced.

While the env works the session holds no decode slot (its request has finished); after
`park_after_s` it is *parked*: its KV is released (`close_session`), and the next turn
recomputes the context from the tokens already persisted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import AgentFlowError, EnvTimeout
from agentflow.inference.base import Engine, GenerateRequest, GenerateResult, SessionRef
from agentflow.metrics import GatewayMetrics
from agentflow.tokenization.tool_calls import ParsedAssistant
from agentflow.types import TurnRecord
from envs.base import StepResult, TextAction, ToolCall, ToolCallsAction


@dataclass
class _Session:
    """The engine session of one episode, which may be parked between turns."""

    engine: Engine
    session_id: str | None = None
    last_rid: str | None = None
    parked: bool = False
    parked_s: float = 0.0

    async def open(self) -> None:
        self.session_id = await self.engine.open_session()
        self.last_rid, self.parked = None, False

    async def park(self) -> None:
        if self.session_id is not None and not self.parked:
            await self.engine.close_session(self.session_id)
            self.parked = True

    async def close(self) -> None:
        if self.session_id is not None and not self.parked:
            with contextlib.suppress(AgentFlowError):
                await self.engine.close_session(self.session_id)
        self.session_id = None


@dataclass
class WhiteBoxAgent:
    """Runs one episode in process. `park_after_s=None` never parks."""

    park_after_s: float | None = 5.0
    step_timeout_s: float | None = 60.0
    step_grace_s: float = 1.0  # beyond the env's own timeout, before the agent gives up
    system_prompt: str | None = None
    metrics: GatewayMetrics | None = None

    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome:
        session = _Session(episode.runtime.engine)
        writes = _Writes(episode)
        await session.open()
        try:
            outcome = await self._loop(episode, session, writes)
        finally:
            try:
                await session.close()
            finally:
                # Every turn is committed before the outcome counts, even when a stop
                # cancels this task while it ends: the run records the outcome as soon as
                # the task is over, and a turn landing after that would be refused.
                await writes.settle()
        return outcome

    async def _loop(
        self, episode: EpisodeHandle, session: _Session, writes: _Writes
    ) -> EpisodeOutcome:
        runtime, budget = episode.runtime, episode.budget
        template = runtime.template
        task = episode.task
        first = await episode.env.reset(seed=task.get("seed"), options=task.get("options"))
        messages = _messages(first)
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        prompt = template.render(messages, tools=episode.env.tools() or None)
        parent = await self._record(
            writes, None, TurnRecord(kind="prompt", token_ids=tuple(prompt.token_ids))
        )
        context: list[int] = list(prompt.token_ids)
        pending: list[int] = list(prompt.token_ids)  # tokens the engine has not seen yet
        reward_total = 0.0

        for _ in range(budget.max_turns):
            room = min(budget.max_tokens, runtime.max_context) - len(context)
            if room <= 0:
                return EpisodeOutcome("truncated", reward_total, "token budget reached")
            if session.parked:  # KV released while the env worked: recompute from the record
                await session.open()
                pending = list(context)
            result, timings = await self._generate(runtime, session, pending, room)
            parent = await self._record(
                writes,
                parent,
                TurnRecord(
                    kind="policy",
                    token_ids=tuple(result.output_ids),
                    logprobs=tuple(result.logprobs),
                    weight_versions=tuple(result.token_versions()),
                    finish_reason=result.finish_reason,
                    timings=timings,
                ),
            )
            context += result.output_ids
            if result.finish_reason == "abort":
                return EpisodeOutcome("aborted", None, "generation aborted by the engine")

            parsed = template.parse_assistant(result.output_ids)
            step, env_s, parked_s = await self._step(episode, session, parsed)
            reward_total += step.reward
            done = step.terminated or step.truncated
            delta = template.render_delta(
                _messages(step), after=result.output_ids, add_generation_prompt=not done
            )
            if delta.token_ids:
                parent = await self._record(
                    writes,
                    parent,
                    TurnRecord(
                        kind="env",
                        token_ids=tuple(delta.token_ids),
                        reward=step.reward,
                        timings={"env": env_s, "parked": parked_s},
                    ),
                )
            context += delta.token_ids
            pending = list(delta.token_ids)
            if step.terminated:
                return EpisodeOutcome("completed", reward_total)
            if step.truncated:
                return EpisodeOutcome("truncated", reward_total, "env truncated the episode")
        limit = f"turn budget ({budget.max_turns}) reached"
        return EpisodeOutcome("truncated", reward_total, limit)

    async def _generate(
        self, runtime: PolicyRuntime, session: _Session, input_ids: Sequence[int], room: int
    ) -> tuple[GenerateResult, dict[str, float]]:
        assert session.session_id is not None
        sampling = runtime.sampling
        params = sampling.model_copy(
            update={"max_new_tokens": max(1, min(sampling.max_new_tokens, room))}
        )
        request = GenerateRequest(
            input_ids=tuple(input_ids),
            sampling=params,
            rid=uuid.uuid4().hex,
            session=SessionRef(session_id=session.session_id, parent_rid=session.last_rid),
            routing_key=session.session_id,
        )
        started = time.perf_counter()
        result = await runtime.generate(request)  # continued across weight updates
        wall = time.perf_counter() - started
        session.last_rid = request.rid
        if self.metrics is not None:
            self.metrics.generate_seconds.observe(wall)
        queue = min(wall, float(getattr(result, "queue_s", 0.0) or 0.0))
        return result, {"queue": queue, "generate": wall - queue}

    async def _step(
        self, episode: EpisodeHandle, session: _Session, parsed: ParsedAssistant
    ) -> tuple[StepResult, float, float]:
        """Step the env; park the session if the env takes longer than `park_after_s`."""
        action: TextAction | ToolCallsAction
        if parsed.tool_calls:
            action = ToolCallsAction(
                calls=[
                    ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.tool_calls
                ]
            )
        else:
            action = TextAction(text=parsed.content[:100_000])
        parker: asyncio.Task[None] | None = None
        parked_at: list[float] = []
        if self.park_after_s is not None:

            async def park_later() -> None:
                await asyncio.sleep(self.park_after_s or 0.0)
                parked_at.append(time.perf_counter())
                if self.metrics is not None:
                    self.metrics.parked_sessions.inc()
                await session.park()

            parker = asyncio.create_task(park_later())
        started = time.perf_counter()
        timeout = episode.step_timeout_s or self.step_timeout_s
        try:
            # The env gets its timeout, and is held to it: an env that hangs fails this
            # episode, never the run.
            limit = None if timeout is None else timeout + self.step_grace_s
            async with asyncio.timeout(limit):
                step = await episode.env.step(action, timeout_s=timeout)
        except TimeoutError:
            raise EnvTimeout(f"the env did not answer a step within {timeout} s") from None
        finally:
            ended = time.perf_counter()
            if parker is not None:
                parker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await parker
                if parked_at and self.metrics is not None:
                    self.metrics.parked_sessions.dec()
        parked_s = ended - parked_at[0] if parked_at else 0.0
        if self.metrics is not None:
            self.metrics.env_seconds.observe(ended - started)
        return step, ended - started, parked_s

    async def _record(
        self, writes: _Writes, parent: uuid.UUID | None, record: TurnRecord
    ) -> uuid.UUID:
        turn_id = await writes.submit(parent, record)
        if self.metrics is not None:
            self.metrics.turns.labels(kind=record.kind).inc()
        return turn_id


class _Writes:
    """An episode's turn writes, queued as each turn completes and committed in the
    background (concurrent episodes share commits), so the loop does not wait on the
    database between turns. At most `window` may be outstanding; a failed write fails
    the episode at the next submit or at the end."""

    def __init__(self, episode: EpisodeHandle, window: int = 4) -> None:
        self.episode = episode
        self.window = window
        self.pending: list[asyncio.Future[None]] = []

    async def submit(self, parent: uuid.UUID | None, record: TurnRecord) -> uuid.UUID:
        if len(self.pending) >= self.window:
            # Shielded: a cancel must not cancel the write itself, which `settle` awaits.
            await asyncio.shield(self.pending[0])
        while self.pending and self.pending[0].done():  # writes commit in order
            self.pending.pop(0).result()  # a failed write raises here, in the loop
        turn_id, committed = self.episode.turns.submit_turn(self.episode.episode_id, parent, record)
        self.pending.append(committed)
        return turn_id

    async def settle(self) -> None:
        """Wait until every queued write is committed (or failed); a cancel that arrives
        meanwhile is raised once they are, never instead."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        done = asyncio.gather(*pending, return_exceptions=True)
        try:
            results = await asyncio.shield(done)
        except asyncio.CancelledError:
            await done
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result


def _messages(step: StepResult) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in step.observation.messages]
