"""Evaluation of a policy on an env: many sampled episodes at once on `LocalEngine`.

`sample_episode` makes the white-box loop's calls (`agentflow.agents.whitebox`): the
prompt rendered with the chat template, then per turn only the new tokens on the
episode's engine session, the parsed reply as the env action, the observation as a token
delta; it skips the database writes, so hundreds of episodes evaluate in seconds.
`evaluate` reports mean reward and success rate over `n` of them.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef
from agentflow.tokenization.chat import ChatTemplate
from agentflow.tokenization.tool_calls import ParsedAssistant
from envs import registry
from envs.base import StepResult, TextAction, ToolCall, ToolCallsAction

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from agentflow.inference.local import LocalEngine


def env_action(parsed: ParsedAssistant) -> TextAction | ToolCallsAction:
    """The env action for a parsed reply, built as the white-box agent builds it."""
    if parsed.tool_calls:
        calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.tool_calls]
        return ToolCallsAction(calls=calls)
    return TextAction(text=parsed.content[:100_000])


def observation_messages(step: StepResult) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in step.observation.messages]


@dataclass
class EvalMetrics:
    episodes: int
    mean_reward: float
    success_rate: float
    mean_turns: float
    seconds: float
    episodes_per_s: float
    generated_tokens: int


@dataclass
class SampledEpisode:
    """One sampled episode as the white-box agent would record it (no database)."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 on sampled tokens
    logprobs: list[float]  # the engine's, per token (0.0 where the mask is 0)
    reward: float
    success: bool
    turns: int


async def sample_episode(
    engine: LocalEngine,
    env_id: str,
    template: ChatTemplate,
    sampling: SamplingParams,
    env_seed: int,
    *,
    max_turns: int = 6,
    max_tokens: int = 512,
) -> SampledEpisode:
    """One episode through the white-box loop's calls: the prompt, then per turn only
    the new tokens on the episode's engine session, the parsed reply as the action, the
    observation as a token delta. Success is the env's `info["success"]` at the end,
    else "terminated with a positive reward"."""
    env = registry.make(env_id)
    session_id = await engine.open_session()
    try:
        first = await env.reset(seed=env_seed)
        pending = template.render(observation_messages(first), tools=env.tools() or None).token_ids
        ids, mask, logprobs = list(pending), [0] * len(pending), [0.0] * len(pending)
        parent: str | None = None
        reward, success, turns = 0.0, False, 0
        for _ in range(max_turns):
            room = min(max_tokens, engine.max_context) - len(ids)
            if room <= 0:
                break
            request = GenerateRequest(
                input_ids=tuple(pending),
                sampling=sampling.model_copy(
                    update={"max_new_tokens": max(1, min(sampling.max_new_tokens, room))}
                ),
                rid=uuid.uuid4().hex,
                session=SessionRef(session_id=session_id, parent_rid=parent),
            )
            result = await engine.generate(request)
            parent = request.rid
            ids += result.output_ids
            mask += [1] * len(result.output_ids)
            logprobs += result.logprobs
            step = await env.step(env_action(template.parse_assistant(result.output_ids)))
            turns += 1
            reward += step.reward
            pending = template.render_delta(
                observation_messages(step),
                after=result.output_ids,
                add_generation_prompt=not step.done,
            ).token_ids
            ids += pending
            mask += [0] * len(pending)
            logprobs += [0.0] * len(pending)
            if step.done:
                success = bool(step.info.get("success", step.terminated and step.reward > 0))
                break
        return SampledEpisode(ids, mask, logprobs, reward, success, turns)
    finally:
        await engine.close_session(session_id)
        await env.close()


async def evaluate(
    policy: PreTrainedModel | LocalEngine,
    env_id: str,
    n: int,
    template: ChatTemplate,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    max_turns: int = 6,
    max_tokens: int = 512,
    max_new_tokens: int = 16,
    concurrency: int = 128,
) -> EvalMetrics:
    """Mean reward and success rate over `n` sampled episodes, `concurrency` at a time.

    `policy` is a model (served here by a `LocalEngine` that shares its weights) or a
    running `LocalEngine`. Success is the env's `info["success"]` at the end, else
    "terminated with a positive reward"."""
    from agentflow.inference.local import LocalEngine

    own = not isinstance(policy, LocalEngine)
    engine = (
        policy
        if isinstance(policy, LocalEngine)
        else LocalEngine(policy, max_batch_size=concurrency, seed=seed)
    )
    sampling = SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=template.stop_ids
    )
    rng = random.Random(seed)
    seeds = [rng.getrandbits(31) for _ in range(n)]
    gate = asyncio.Semaphore(concurrency)

    async def one(env_seed: int) -> SampledEpisode:
        async with gate:
            return await sample_episode(
                engine,
                env_id,
                template,
                sampling,
                env_seed,
                max_turns=max_turns,
                max_tokens=max_tokens,
            )

    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(s) for s in seeds))
    finally:
        if own:
            await engine.close()
    seconds = time.perf_counter() - started
    count = max(1, n)
    return EvalMetrics(
        episodes=n,
        mean_reward=round(sum(r.reward for r in results) / count, 4),
        success_rate=round(sum(r.success for r in results) / count, 4),
        mean_turns=round(sum(r.turns for r in results) / count, 3),
        seconds=round(seconds, 2),
        episodes_per_s=round(n / max(seconds, 1e-9), 1),
        generated_tokens=sum(sum(r.loss_mask) for r in results),
    )
