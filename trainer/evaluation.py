"""Evaluation of a policy on an env: many sampled episodes at once on `LocalEngine`.

Episodes are played by the episode loop (`agentflow.agents.episode`), exactly as in RL,
but kept in memory instead of the turn tree, so hundreds evaluate in seconds.
`evaluate` reports mean reward and success rate over `n` of them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentflow.agents.actions import SampledActions
from agentflow.agents.base import Budget
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import MemoryRecorder
from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import SamplingParams
from agentflow.tokenization.chat import ChatTemplate
from envs import registry

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedModel

    from agentflow.inference.local import LocalEngine
    from agentflow.run_config import RunConfig


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
    runtime: PolicyRuntime,
    env_id: str,
    env_seed: int,
    *,
    budget: Budget | None = None,
    system_prompt: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
) -> SampledEpisode:
    """One episode played by the episode loop on `runtime`'s engine, kept in memory.
    Success is the env's `info["success"]` at the end, else "terminated with a positive
    reward"."""
    loop = EpisodeLoop(
        runtime.template,
        budget or Budget(max_turns=6, max_tokens=512),
        runtime.max_context,
        system_prompt=system_prompt,
    )
    env = registry.make(env_id, **(env_kwargs or {}))
    recorder = MemoryRecorder()
    try:
        outcome = await loop.play(
            env, {"seed": env_seed}, SampledActions(runtime, park_after_s=None), recorder
        )
    finally:
        await env.close()
    return SampledEpisode(
        recorder.token_ids,
        recorder.loss_mask,
        recorder.logprobs,
        outcome.reward or 0.0,
        outcome.success,
        outcome.turns,
    )


async def evaluate(
    policy: PreTrainedModel | LocalEngine,
    env_id: str | Sequence[str],
    n: int,
    template: ChatTemplate,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    max_turns: int = 6,
    max_tokens: int = 512,
    max_new_tokens: int = 16,
    concurrency: int = 128,
    system_prompt: str | None = None,
    env_kwargs: dict[str, dict[str, Any]] | None = None,
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
    runtime = PolicyRuntime(
        engine,
        template,
        sampling=SamplingParams(
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            stop_token_ids=template.stop_ids,
        ),
        max_context=engine.max_context,
        partial_rollout=False,
    )
    budget = Budget(max_turns=max_turns, max_tokens=max_tokens)
    rng = random.Random(seed)
    seeds = [rng.getrandbits(31) for _ in range(n)]
    env_ids = [env_id] if isinstance(env_id, str) else list(env_id)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, env_seed: int) -> SampledEpisode:
        async with gate:
            return await sample_episode(
                runtime,
                env_ids[i % len(env_ids)],  # several envs take turns
                env_seed,
                budget=budget,
                system_prompt=system_prompt,
                env_kwargs=(env_kwargs or {}).get(env_ids[i % len(env_ids)]),
            )

    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(seeds)))
    finally:
        try:
            if own:
                await engine.close()
        finally:
            await registry.close_shared()
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


def evaluate_run_model(
    config: RunConfig, model_path: str | Path, *, episodes: int = 400, seed: int = 0
) -> dict[str, EvalMetrics]:
    """`model_path` played on each env of `config`'s mix as the run's agent plays it (its
    budgets, system prompt, temperature, env kwargs): `episodes` sampled episodes each."""
    from agentflow.modeling import load_model, tokenizer_kind
    from agentflow.tokenization import load_tokenizer
    from agentflow.tokenization.chat import chat_template_for

    model = load_model(model_path)
    kind = tokenizer_kind(model)
    template = chat_template_for(load_tokenizer("bytes" if kind == "bytes" else model_path))
    agent = config.agent
    out: dict[str, EvalMetrics] = {}
    for entry in config.envs:
        out[entry.id] = asyncio.run(
            evaluate(
                model,
                entry.id,
                episodes,
                template,
                temperature=agent.temperature,
                seed=seed,
                max_turns=agent.max_turns,
                max_tokens=agent.max_tokens,
                max_new_tokens=agent.max_new_tokens,
                system_prompt=agent.system_prompt,
                env_kwargs={entry.id: dict(entry.kwargs)} if entry.kwargs else None,
            )
        )
    return out
