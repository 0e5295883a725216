"""Where the episode loop's replies come from (`agentflow.agents.episode.ActionSource`).

- `SampledActions`: the policy engine, through the run's `PolicyRuntime`. Each episode
  has its own engine session, so each turn sends only the tokens the session has not
  seen. While the env works the session holds no decode slot (its request has finished);
  after `park_after_s` it is *parked*: its KV is released (`close_session`), and the next
  turn recomputes the context from the tokens already recorded. A turn whose engine died
  (`EngineLost`, from an `EnginePool`) is sent again the same way, on a new session.
- `ScriptedActions`: a scripted player (an env's oracle), its moves rendered as the
  tokens a policy emits for them, so supervised data has exactly RL's token format.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentflow import ids
from agentflow.agents.episode import EnvWait, EpisodeState, Reply
from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import AgentFlowError, EngineLost, InvalidInput
from agentflow.inference.base import GenerateRequest, SessionRef
from agentflow.metrics import GatewayMetrics
from agentflow.tokenization.chat import ChatTemplate
from agentflow.tokenization.tool_calls import ToolCallStyle, render_tool_call
from envs.base import Observation, TextAction, ToolCallsAction

ScriptedPolicy = Callable[[Sequence[Observation]], Any]  # observations so far -> an action


@dataclass
class _Wait:
    parked_s: float = 0.0


class SampledActions:
    """Replies sampled by the run's engine on one session per episode."""

    def __init__(
        self,
        runtime: PolicyRuntime,
        *,
        park_after_s: float | None = 5.0,
        metrics: GatewayMetrics | None = None,
        resends_on_lost_engine: int = 2,
    ) -> None:
        self.runtime = runtime
        self.resends_on_lost_engine = resends_on_lost_engine
        self.park_after_s = park_after_s
        self.metrics = metrics
        self.session_id: str | None = None
        self.last_rid: str | None = None
        self.parked = False
        self.seen = 0  # context tokens the engine session holds
        self.resent = 0  # turns sent again after their engine died

    async def open(self) -> None:
        self.session_id = await self.runtime.engine.open_session()
        self.last_rid, self.parked, self.seen = None, False, 0

    async def close(self) -> None:
        if self.session_id is not None and not self.parked:
            with contextlib.suppress(AgentFlowError):
                await self.runtime.engine.close_session(self.session_id)
        self.session_id = None

    async def _park(self) -> None:
        if self.session_id is not None and not self.parked:
            await self.runtime.engine.close_session(self.session_id)
            self.parked = True

    async def reply(self, state: EpisodeState) -> Reply:
        runtime = self.runtime
        sampling = runtime.sampling
        params = sampling
        if state.room < sampling.max_new_tokens:  # a copy only when the budget shortens it
            params = sampling.model_copy(update={"max_new_tokens": max(1, state.room)})
        started = time.perf_counter()
        for attempt in range(self.resends_on_lost_engine + 1):
            if self.parked:  # KV released while the env worked: recompute from the record
                await self.open()
            assert self.session_id is not None
            request = GenerateRequest(
                input_ids=tuple(state.context[self.seen :]),
                sampling=params,
                rid=ids.new_hex(),
                session=SessionRef(session_id=self.session_id, parent_rid=self.last_rid),
                routing_key=self.session_id,
            )
            try:
                result = await runtime.generate(request)  # continued across weight updates
                break
            except EngineLost:
                # Its engine died with the session; nothing of this turn was recorded, so
                # a new session elsewhere recomputes the context and samples the turn anew.
                if attempt == self.resends_on_lost_engine:
                    raise
                self.parked = True  # the session is gone: nothing to close
                self.resent += 1
        wall = time.perf_counter() - started
        self.last_rid = request.rid
        self.seen = len(state.context) + len(result.output_ids)
        if self.metrics is not None:
            self.metrics.generate_seconds.observe(wall)
        queue = min(wall, result.queue_s)
        return Reply(
            output_ids=result.output_ids,
            logprobs=result.logprobs,
            weight_versions=result.token_versions(),
            finish_reason=result.finish_reason,
            timings={"queue": queue, "generate": wall - queue},
            checked=True,  # a `GenerateResult`'s ids, log-probs and versions
        )

    def waiting(self) -> _Parking:
        """Park the session if the env takes longer than `park_after_s`."""
        return _Parking(self)


class _Parking:
    """`SampledActions.waiting`: entered once per env step, so a class rather than a
    generator-based context manager (less work per step)."""

    def __init__(self, actions: SampledActions) -> None:
        self.actions = actions
        self.wait = _Wait()
        self.timer: asyncio.TimerHandle | None = None
        self.parked_at: float | None = None
        self.parking: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Wait:
        after_s = self.actions.park_after_s
        if after_s is not None:
            # A timer, not a task per wait: most env steps end long before it fires.
            self.timer = asyncio.get_running_loop().call_later(after_s, self._park)
        return self.wait

    def _park(self) -> None:
        self.parked_at = time.perf_counter()
        if self.actions.metrics is not None:
            self.actions.metrics.parked_sessions.inc()
        self.parking = asyncio.create_task(self.actions._park())

    async def __aexit__(self, *exc_info: object) -> None:
        if self.timer is None:
            return
        ended = time.perf_counter()
        self.timer.cancel()
        if self.parking is not None:
            self.parking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.parking
        if self.parked_at is not None:
            self.wait.parked_s = ended - self.parked_at
            if self.actions.metrics is not None:
                self.actions.metrics.parked_sessions.dec()


class ScriptedActions:
    """Replies of a scripted player: each move rendered as the tokens a policy emits
    (`reply_token_ids`). Log-probs 0.0 and weight version 0: nothing sampled them."""

    def __init__(self, template: ChatTemplate, policy: ScriptedPolicy) -> None:
        self.template = template
        self.policy = policy

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def reply(self, state: EpisodeState) -> Reply:
        ids = reply_token_ids(self.template, self.policy(state.observations))
        return Reply(output_ids=ids, logprobs=[0.0] * len(ids), weight_versions=[0] * len(ids))

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[EnvWait]:
        yield _Wait()


def reply_token_ids(template: ChatTemplate, action: Any) -> list[int]:
    """The tokens a policy emits for `action` (a text or tool-calls action): its text,
    its tool calls in the template's style, then the first stop token, which is where the
    engine ends a turn. Checked by parsing them back as the episode loop does."""
    tok = template.tokenizer
    style: ToolCallStyle = getattr(template, "tool_call_style", "agentflow")
    if isinstance(action, TextAction):
        ids, calls = tok.encode(action.text), []
    elif isinstance(action, ToolCallsAction):
        calls = action.calls
        ids = []
        for call in calls:
            text = render_tool_call({"name": call.name, "arguments": call.arguments}, style)
            ids += tok.encode(text, allow_special=True)
    else:
        raise InvalidInput(f"cannot render a {type(action).__name__} as tokens", field="action")
    ids.append(template.stop_ids[0])
    parsed = template.parse_assistant(ids)
    same = [(c.name, c.arguments) for c in parsed.tool_calls] == [
        (c.name, c.arguments) for c in calls
    ]
    text = action.text.strip() if isinstance(action, TextAction) else ""
    if not same or parsed.content != text:
        raise InvalidInput(f"the template does not round-trip the action {action!r}")
    return ids
