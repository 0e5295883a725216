"""The one white-box episode loop (docs/architecture.md, "How an episode runs").

White-box RL, evaluation and the warm start's data all play episodes through
`EpisodeLoop.play`, so what the warm start trains on is, token for token, what RL samples
and records. The loop is parameterized by two seams:

- an `ActionSource` makes the policy's reply to the context so far: the engine sampling
  through the run's `PolicyRuntime` (`agentflow.agents.actions.SampledActions`), or a
  scripted player rendered as the tokens a policy would emit (`ScriptedActions`);
- a `Recorder` keeps the turns: the turn tree (`agentflow.agents.recorders.TurnTreeRecorder`)
  or in-memory lists (`MemoryRecorder`).

Per episode: render the prompt (the env's first messages, the system prompt when the env
gives none, the tool schemas) with the chat template; then per turn the source's reply
(a policy turn), the reply parsed into an env action, the env's step, and the new
messages rendered as a token delta after the reply (an env turn). Nothing is ever
re-tokenized. The episode ends when the env terminates or truncates, or a turn or token
budget is hit (recorded as truncated, never silently cut).

`play(..., start=path)` continues an episode from any turn of a stored tree (an RTPO
re-rollout, a resumed computer-use episode): the env is reset with the same task and the
stored policy turns are replayed into it, each stored env turn checked against what the
env answers now; then the loop goes on from the last stored turn, and the recorder appends
beneath it. An env that does not replay the same way fails with `ReplayMismatch`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentflow.agents.base import Budget, EpisodeOutcome, OutcomeStatus
from agentflow.errors import EnvTimeout, InvalidInput
from agentflow.metrics import GatewayMetrics
from agentflow.tokenization.chat import ChatTemplate
from agentflow.tokenization.tool_calls import ParsedAssistant
from agentflow.types import StoredTurn, TurnRecord
from envs.base import Env, Observation, StepResult, TextAction, ToolCall, ToolCallsAction
from envs.turn_env import TurnEnv

MAX_TEXT_ACTION = 100_000  # characters: the env protocol's limit on a text action


class ReplayMismatch(InvalidInput):
    """A stored episode cannot be continued: the env answers its replay differently."""


@dataclass
class EpisodeState:
    """What an action source sees when it is asked for the next reply."""

    context: list[int]  # every token of the episode so far
    observations: list[Observation]  # reset's, then each step's
    room: int  # tokens the reply may take before the token budget is reached


@dataclass(frozen=True)
class Reply:
    """The policy's reply: its tokens, and per token the log-prob and weight version."""

    output_ids: Sequence[int]
    logprobs: Sequence[float]
    weight_versions: Sequence[int]
    finish_reason: str = "stop"
    timings: dict[str, float] = field(default_factory=dict)
    # Its tokens, log-probs and versions were checked where they came in (an engine's
    # `GenerateResult`): the turn record takes them without checking each again.
    checked: bool = False


class EnvWait(Protocol):
    parked_s: float  # how long the source's resources were released while the env worked


class ActionSource(Protocol):
    async def open(self) -> None: ...

    async def reply(self, state: EpisodeState) -> Reply: ...

    def waiting(self) -> AbstractAsyncContextManager[EnvWait]:
        """Entered while the env steps (an engine session may be parked meanwhile)."""
        ...

    async def close(self) -> None: ...


class Recorder(Protocol):
    async def record(self, record: TurnRecord) -> None:
        """Append `record` after the last turn recorded (or the start turn)."""
        ...

    async def settle(self) -> None:
        """Wait until every recorded turn is kept; raise the first failure."""
        ...


def env_action(parsed: ParsedAssistant) -> TextAction | ToolCallsAction:
    """The env action of a parsed reply: its tool calls, else its text."""
    if parsed.tool_calls:
        calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.tool_calls]
        return ToolCallsAction(calls=calls)
    return TextAction(text=parsed.content[:MAX_TEXT_ACTION])


def _images(step: StepResult) -> tuple[bytes, ...]:
    """The observation's screenshot (browser and desktop envs send one every step), kept
    as a blob linked from the turn that records the observation."""
    image = step.observation.image
    return (image,) if image else ()


def observation_messages(step: StepResult) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in step.observation.messages]


@dataclass
class EpisodeLoop:
    """How episodes are played: the template, budgets, prompt and env time limits."""

    template: ChatTemplate
    budget: Budget = field(default_factory=Budget)
    max_context: int = 4096
    system_prompt: str | None = None
    step_timeout_s: float | None = 60.0
    step_grace_s: float = 1.0  # beyond the env's own timeout, before the loop gives up
    metrics: GatewayMetrics | None = None

    async def play(
        self,
        env: Env,
        task: dict[str, Any],
        actions: ActionSource,
        recorder: Recorder,
        *,
        start: Sequence[StoredTurn] | None = None,
    ) -> EpisodeOutcome:
        """One episode (from `start`, a stored root → turn path, when given). Every turn
        is kept by the recorder before this returns, even when it is cancelled."""
        await actions.open()
        try:
            return await self._loop(env, task, actions, recorder, start)
        finally:
            try:
                await actions.close()
            finally:
                # Every turn is committed before the outcome counts, even when a stop
                # cancels this task while it ends: a run records the outcome as soon as
                # the task is over, and a turn landing after that would be refused.
                await recorder.settle()

    def prompt_token_ids(self, env: Env, first: StepResult) -> list[int]:
        messages = observation_messages(first)
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return list(self.template.render(messages, tools=env.tools() or None).token_ids)

    async def _loop(
        self,
        env: Env,
        task: dict[str, Any],
        actions: ActionSource,
        recorder: Recorder,
        start: Sequence[StoredTurn] | None,
    ) -> EpisodeOutcome:
        first = await env.reset(seed=task.get("seed"), options=task.get("options"))
        prompt = self.prompt_token_ids(env, first)
        progress = _Progress(context=list(prompt), observations=[first.observation])
        if start:
            await self._replay(env, actions, recorder, start, progress)
        else:
            await self._record(
                recorder,
                TurnRecord(kind="prompt", token_ids=tuple(prompt), images=_images(first)),
            )

        budget = self.budget
        while (ended := progress.ended()) is None:
            if progress.turns >= budget.max_turns:
                return progress.outcome("truncated", f"turn budget ({budget.max_turns}) reached")
            room = min(budget.max_tokens, self.max_context) - len(progress.context)
            if room <= 0:
                return progress.outcome("truncated", "token budget reached")
            reply = await actions.reply(EpisodeState(progress.context, progress.observations, room))
            make = TurnRecord.checked_upstream if reply.checked else TurnRecord
            await self._record(
                recorder,
                make(
                    kind="policy",
                    token_ids=tuple(reply.output_ids),
                    logprobs=tuple(reply.logprobs),
                    weight_versions=tuple(reply.weight_versions),
                    finish_reason=reply.finish_reason,
                    timings=reply.timings,
                ),
            )
            progress.context += reply.output_ids
            if reply.finish_reason == "abort":
                return EpisodeOutcome(
                    "aborted", None, "generation aborted by the engine", turns=progress.turns
                )
            await self._act(env, actions, recorder, reply.output_ids, progress)
        return ended

    async def _act(
        self,
        env: Env,
        actions: ActionSource,
        recorder: Recorder,
        reply_ids: Sequence[int],
        progress: _Progress,
    ) -> None:
        """Step the env with a reply and record what it answers."""
        step, env_s, parked_s = await self._step(env, actions, reply_ids)
        delta = self._delta(step, reply_ids)
        images = _images(step)
        if delta or images:  # a screenshot is kept even when no message came with it
            await self._record(
                recorder,
                # The delta is the chat template's own ids; the env's reward and images
                # are checked.
                TurnRecord.checked_upstream(
                    kind="env",
                    token_ids=tuple(delta),
                    reward=step.reward,
                    timings={"env": env_s, "parked": parked_s},
                    images=images,
                ),
            )
        progress.advance(step, delta)

    async def _replay(
        self,
        env: Env,
        actions: ActionSource,
        recorder: Recorder,
        path: Sequence[StoredTurn],
        progress: _Progress,
    ) -> None:
        """Bring the env to the end of a stored root → turn path, checking each stored env
        turn against what the env answers now."""
        if path[0].kind != "prompt" or list(path[0].token_ids) != progress.context:
            raise ReplayMismatch("the env's first observation differs from the stored prompt")
        i = 1
        while i < len(path) and progress.ended() is None:
            reply = path[i]
            if reply.kind != "policy":
                raise ReplayMismatch(f"turn {reply.id} ({reply.kind}) does not follow a reply")
            progress.context += reply.token_ids
            i += 1
            if i == len(path):  # the path ends at a reply: the env's answer is a new turn
                await self._act(env, actions, recorder, reply.token_ids, progress)
                return
            step, _, _ = await self._step(env, actions, reply.token_ids)
            delta = self._delta(step, reply.token_ids)
            stored: list[int] = []
            if path[i].kind == "env":
                stored = list(path[i].token_ids)
                i += 1
            if stored != delta:
                raise ReplayMismatch(f"the env answers turn {reply.id} differently now")
            progress.advance(step, delta)
        if i < len(path):
            raise ReplayMismatch("the env ended the episode before the stored path ends")

    def _delta(self, step: StepResult, reply_ids: Sequence[int]) -> list[int]:
        return list(
            self.template.render_delta(
                observation_messages(step), after=reply_ids, add_generation_prompt=not step.done
            ).token_ids
        )

    async def _step(
        self, env: Env, actions: ActionSource, reply_ids: Sequence[int]
    ) -> tuple[StepResult, float, float]:
        action = env_action(self.template.parse_assistant(reply_ids))
        started = time.perf_counter()
        timeout = self.step_timeout_s
        async with actions.waiting() as wait:
            try:
                if timeout is not None and type(env).step is TurnEnv.step:
                    # `TurnEnv.step` holds itself to the timeout (`StepTimeout`), in this
                    # task: a second timer around it would only add a timer per step.
                    step = await env.step(action, timeout_s=timeout)
                else:
                    # The env gets its timeout, and is held to it: an env that hangs fails
                    # this episode, never the run.
                    limit = None if timeout is None else timeout + self.step_grace_s
                    async with asyncio.timeout(limit):
                        step = await env.step(action, timeout_s=timeout)
            except TimeoutError:
                raise EnvTimeout(f"the env did not answer a step within {timeout} s") from None
            finally:
                env_s = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.env_seconds.observe(env_s)
        return step, env_s, wait.parked_s

    async def _record(self, recorder: Recorder, record: TurnRecord) -> None:
        await recorder.record(record)
        if self.metrics is not None:
            self.metrics.turns.labels(kind=record.kind).inc()


@dataclass
class _Progress:
    """Where an episode stands: its tokens, what the env said, rewards and turns."""

    context: list[int]
    observations: list[Observation]
    reward: float = 0.0
    turns: int = 0
    last: StepResult | None = None

    def advance(self, step: StepResult, delta: Sequence[int]) -> None:
        self.context += delta
        self.observations.append(step.observation)
        self.reward += step.reward
        self.turns += 1
        self.last = step

    def ended(self) -> EpisodeOutcome | None:
        if self.last is None or not self.last.done:
            return None
        if self.last.terminated:
            return self.outcome("completed", None)
        return self.outcome("truncated", "env truncated the episode")

    def outcome(self, status: OutcomeStatus, error: str | None) -> EpisodeOutcome:
        """Success is the env's `info["success"]` at the end, else "terminated with a
        positive reward"."""
        step = self.last
        success = False
        if step is not None and step.done:
            success = bool(step.info.get("success", step.terminated and step.reward > 0))
        return EpisodeOutcome(status, self.reward, error, turns=self.turns, success=success)
