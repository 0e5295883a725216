"""Warm start: supervised fine-tuning on an env's scripted (oracle) episodes, and evaluation.

RL from a random byte-level model almost never finds a reward, so a run starts from a
policy that already speaks the env's format and half-solves it. This module makes that
policy:

- `oracle_episodes` plays an env with its *noisy* oracle (the scripted solution with
  probability `p_oracle`, else a random move) through the episode loop RL uses
  (`agentflow.agents.episode`), with the agent's system prompt and budgets; each move is
  rendered as the tokens the engine would emit (`ScriptedActions`). Only reply tokens
  carry loss mask 1. The policy therefore learns the very token format that RL samples
  and parses.
- `sft` trains a causal LM on such sequences (AdamW, warm-up then cosine decay, padded
  batches of similar length); `sft_from_trajectories` does the same on stored
  `Trajectory` objects, with their own loss masks.
- `evaluate` (`trainer.evaluation`) samples episodes with the local engine, many at once,
  through the same loop, kept in memory, and reports mean reward and success rate.
- `run_sft` does all of it from one `SftConfig` and saves an HF-format checkpoint.

Why a noisy oracle, not the oracle: a near-perfect warm start leaves RL nothing to
improve, and a policy that never saw its own mistakes cannot recover from them. With
`p_oracle = 0.35` on guess-number the data succeeds about half the time. Measured on 2
CPU cores (2 layers x hidden 128): two epochs on 20k episodes in batches of 32 give a
sampled success of 0.42 (mean reward 0.34); batches of 64 or 128, or 4 layers, reach
only 0.35-0.37 in the same number of epochs: many small steps matter more than size.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from agentflow.agents.actions import ScriptedActions, ScriptedPolicy
from agentflow.agents.base import Budget
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import MemoryRecorder
from agentflow.errors import InvalidInput
from agentflow.modeling import ModelInit, build_model, load_model, save_model
from agentflow.tokenization.chat import ChatTemplate, chat_template_for
from agentflow.types import Trajectory
from envs import registry
from trainer.evaluation import evaluate

if TYPE_CHECKING:
    from transformers import PreTrainedModel


OraclePolicy = ScriptedPolicy
SFT_METRICS_FILE = "sft_metrics.json"


@dataclass(frozen=True)
class SftSequence:
    """One rendered episode: its tokens, which of them are trained on, and how it went."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    reward: float = 0.0
    turns: int = 0
    env_seed: int | None = None  # the task seed (`env.reset(seed=...)`) that replays it


# -- rendering episodes as the white-box agent does -------------------------------------


def noisy_policy(env_id: str, p_oracle: float, seed: int) -> OraclePolicy:
    """A fresh per-episode policy: the env module's `noisy_oracle(p_oracle, seed)` when
    it has one, else the registered oracle (only allowed with `p_oracle == 1`)."""
    if p_oracle >= 1.0:
        return registry.oracle(env_id)
    make_noisy = registry.noisy_oracle_factory(env_id)
    if make_noisy is None:
        raise InvalidInput(
            f"env {env_id!r} has no noisy oracle: use p_oracle = 1", field="p_oracle"
        )
    return make_noisy(p_oracle, seed)


async def _oracle_episode(
    loop: EpisodeLoop,
    env_id: str,
    policy: OraclePolicy,
    env_seed: int,
    env_kwargs: dict[str, Any] | None = None,
) -> SftSequence:
    env = registry.make(env_id, **(env_kwargs or {}))
    recorder = MemoryRecorder()
    try:
        outcome = await loop.play(
            env, {"seed": env_seed}, ScriptedActions(loop.template, policy), recorder
        )
    finally:
        await env.close()
    return SftSequence(
        tuple(recorder.token_ids),
        tuple(recorder.loss_mask),
        outcome.reward or 0.0,
        outcome.turns,
        env_seed,
    )


async def oracle_episodes(
    env_id: str | Sequence[str],
    n: int,
    template: ChatTemplate,
    *,
    p_oracle: float = 0.35,
    seed: int = 0,
    max_turns: int = 6,
    max_tokens: int = 512,
    system_prompt: str | None = None,
    concurrency: int = 1,
    env_kwargs: dict[str, dict[str, Any]] | None = None,
) -> list[SftSequence]:
    """`n` episodes of the env's noisy oracle, played by the episode loop RL uses (see the
    module docstring). `max_turns`, `max_tokens` and `system_prompt` are the agent's; the
    same `seed` gives the same episodes. Several env ids share the `n` episodes in turn
    (a run's env mix); `concurrency` episodes play at once (envs that wait on a browser);
    `env_kwargs` are each env id's arguments (the run's `[[envs]] kwargs`)."""
    if n < 0:
        raise InvalidInput("n must be >= 0", field="n")
    env_ids = [env_id] if isinstance(env_id, str) else list(env_id)
    if not env_ids:
        raise InvalidInput("at least one env id is needed", field="env_id")
    loop = EpisodeLoop(
        template,
        Budget(max_turns=max_turns, max_tokens=max_tokens),
        max_context=max_tokens,
        system_prompt=system_prompt,
    )
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        env_seed, policy_seed = rng.getrandbits(31), rng.getrandbits(31)
        plan.append((env_ids[i % len(env_ids)], env_seed, policy_seed))
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(env: str, env_seed: int, policy_seed: int) -> SftSequence:
        async with gate:
            policy = noisy_policy(env, p_oracle, policy_seed)
            kwargs = (env_kwargs or {}).get(env)
            return await _oracle_episode(loop, env, policy, env_seed, kwargs)

    try:
        return list(await asyncio.gather(*(one(*item) for item in plan)))
    finally:
        await registry.close_shared()


# -- training ---------------------------------------------------------------------------


@dataclass
class SftMetrics:
    steps: int = 0
    epochs: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # process CPU time, all threads (wall time varies with load)
    tokens_per_s: float = 0.0  # all positions the model ran on, padding excluded
    trained_tokens: int = 0  # loss-masked tokens seen
    stopped_early: bool = False  # max_seconds reached
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss)


def _batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices in batches of similar length: shuffle, sort within windows of 16 batches,
    cut, shuffle the batches (little padding, still a random order)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: lengths[i])
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def sft(
    model: PreTrainedModel,
    sequences: Sequence[SftSequence],
    *,
    epochs: float = 2.0,
    batch_size: int = 32,
    lr: float = 1e-3,
    warmup: float = 0.05,
    seed: int = 0,
    weight_decay: float = 0.0,
    max_seconds: float | None = None,
    log: Callable[[int, float], None] | None = None,
    log_every: int = 10,
) -> SftMetrics:
    """Train `model` in place on the loss-masked tokens of `sequences`: mean next-token
    cross-entropy over mask-1 positions, AdamW, linear warm-up over the first `warmup`
    fraction of steps, then cosine decay to 10% of `lr`. Stops after `epochs` (may be
    fractional) or `max_seconds`. `log(step, loss)` is called every `log_every` steps."""
    import torch

    if not sequences:
        raise InvalidInput("no sequences to train on", field="sequences")
    if epochs <= 0 or batch_size < 1 or lr <= 0 or not 0 <= warmup < 1:
        raise InvalidInput("need epochs > 0, batch_size >= 1, lr > 0, 0 <= warmup < 1")
    pad = int(getattr(model.config, "pad_token_id", None) or 0)
    device = next(model.parameters()).device
    rng = random.Random(seed)
    lengths = [len(s.token_ids) for s in sequences]
    steps_per_epoch = math.ceil(len(sequences) / batch_size)
    total = max(1, round(epochs * steps_per_epoch))
    warm = max(1, round(warmup * total))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    metrics = SftMetrics()
    model.train()
    started, cpu_started = time.perf_counter(), time.process_time()
    seen_tokens, window_loss, window_n = 0, 0.0, 0
    step = 0
    try:
        while step < total:
            for batch in _batches(lengths, batch_size, rng):
                if step >= total:
                    break
                if max_seconds is not None and time.perf_counter() - started > max_seconds:
                    metrics.stopped_early = True
                    break
                width = max(lengths[i] for i in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.bool)
                for row, i in enumerate(batch):
                    seq = sequences[i]
                    ids[row, : lengths[i]] = torch.tensor(seq.token_ids)
                    mask[row, : lengths[i]] = torch.tensor(seq.loss_mask, dtype=torch.bool)
                ids, mask = ids.to(device), mask.to(device)
                # Right padding under a causal mask never reaches a real token: no
                # attention mask is needed, and SDPA keeps its fast causal path.
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits
                target_mask = mask[:, 1:]
                loss = torch.nn.functional.cross_entropy(
                    logits[target_mask].float(), ids[:, 1:][target_mask]
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                seen_tokens += sum(lengths[i] for i in batch)
                metrics.trained_tokens += int(target_mask.sum())
                window_loss, window_n = window_loss + loss.item(), window_n + 1
                if step % log_every == 0 or step == total:
                    mean = window_loss / window_n
                    metrics.losses.append((step, mean))
                    window_loss, window_n = 0.0, 0
                    if log is not None:
                        log(step, mean)
            if metrics.stopped_early:
                break
    finally:
        model.eval()
    metrics.steps = step
    metrics.epochs = round(step / steps_per_epoch, 3)
    metrics.seconds = round(time.perf_counter() - started, 2)
    metrics.cpu_seconds = round(time.process_time() - cpu_started, 2)
    metrics.tokens_per_s = round(seen_tokens / max(metrics.seconds, 1e-9), 1)
    return metrics


def sft_from_trajectories(
    model: PreTrainedModel, trajectories: Sequence[Trajectory], **kwargs: Any
) -> SftMetrics:
    """`sft` on stored trajectories, trained where their own loss mask is 1."""
    sequences = [
        SftSequence(t.token_ids, t.loss_mask, t.reward or 0.0)
        for t in trajectories
        if any(t.loss_mask)
    ]
    return sft(model, sequences, **kwargs)


# -- one call: data, training, evaluation, checkpoint ---------------------------------


class SftConfig(BaseModel):
    """The warm start of a run (`agentflow sft`)."""

    model_config = ConfigDict(extra="forbid")

    env_id: str | list[str] = Field(
        default="agentflow/guess-number-v0",
        description="env(s) to imitate; several share the episodes in turn",
    )
    concurrency: int = Field(
        default=1, ge=1, le=4096, description="episodes played at once (data and evaluation)"
    )
    env_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="arguments of each env id, as the run gives them"
    )
    n_episodes: int = Field(default=20_000, ge=1, le=10_000_000, description="oracle episodes")
    p_oracle: float = Field(
        default=0.35,
        ge=0.0,
        le=1.0,
        description="probability of the scripted move at each turn (else a random one); "
        "lower leaves RL more to improve",
    )
    min_reward: float | None = Field(
        default=None,
        description="train only on episodes with at least this reward (filtered imitation: "
        "the noisy player's wins); None: every episode",
    )
    max_turns: int = Field(default=6, ge=1, le=1000, description="agent turn budget")
    max_tokens: int = Field(default=512, ge=1, description="agent token budget per episode")
    max_new_tokens: int = Field(default=16, ge=1, description="tokens per sampled turn (eval)")
    system_prompt: str | None = Field(
        default=None, description="the agent's system prompt, prepended when the env has none"
    )
    epochs: float = Field(default=2.0, gt=0, le=100, description="passes over the data")
    batch_size: int = Field(
        default=32, ge=1, le=65536, description="sequences per step (small: more steps)"
    )
    lr: float = Field(default=1e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup: float = Field(
        default=0.05, ge=0.0, lt=1.0, description="fraction of steps of linear warm-up"
    )
    seed: int = Field(default=0, ge=0, description="data, order and model-init seed")
    max_seconds: float | None = Field(
        default=None, gt=0, description="stop training after this long (None: no limit)"
    )
    eval_episodes: int = Field(
        default=400, ge=0, le=1_000_000, description="sampled (T=1) episodes to evaluate on"
    )


def run_sft(
    config: SftConfig,
    model: ModelInit | str | Path,
    out_dir: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build or load the model, make the oracle data, train, evaluate (sampled, T=1),
    save the checkpoint to `out_dir` with `sft_metrics.json` beside it; the metrics.
    `progress` gets a line after each phase and every 20 training steps (a warm start on
    browser envs takes minutes)."""
    say = progress or (lambda line: None)
    if isinstance(model, ModelInit):
        net = build_model(model, seed=config.seed)
    else:
        net = load_model(model)
    from agentflow.modeling import tokenizer_kind

    if tokenizer_kind(net) != "bytes":
        from agentflow.tokenization import load_tokenizer

        template = chat_template_for(load_tokenizer(str(model)))
    else:
        from agentflow.tokenization.bytes import ByteTokenizer

        template = chat_template_for(ByteTokenizer())

    started = time.perf_counter()
    data = asyncio.run(
        oracle_episodes(
            config.env_id,
            config.n_episodes,
            template,
            p_oracle=config.p_oracle,
            seed=config.seed,
            max_turns=config.max_turns,
            max_tokens=config.max_tokens,
            system_prompt=config.system_prompt,
            concurrency=config.concurrency,
            env_kwargs=config.env_kwargs,
        )
    )
    data_s = time.perf_counter() - started
    say(
        f"warm start data: {len(data)} episodes in {data_s:.0f} s, oracle mean reward "
        f"{sum(s.reward for s in data) / max(1, len(data)):.2f}"
    )
    kept = data if config.min_reward is None else [s for s in data if s.reward >= config.min_reward]
    if not kept:
        raise InvalidInput(
            f"no oracle episode reached min_reward {config.min_reward}", field="min_reward"
        )
    train = sft(
        net,
        kept,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        warmup=config.warmup,
        seed=config.seed,
        max_seconds=config.max_seconds,
        log=lambda step, loss: say(f"warm start step {step}: loss {loss:.4f}"),
        log_every=20,
    )
    say(f"warm start training: {train.steps} steps in {train.seconds:.0f} s")
    metrics: dict[str, Any] = {
        "config": config.model_dump(),
        "data": {
            "episodes": len(data),
            "seconds": round(data_s, 2),
            "oracle_mean_reward": round(sum(s.reward for s in data) / len(data), 4),
            "trained_on": len(kept),
            "tokens": sum(len(s.token_ids) for s in data),
        },
        "train": asdict(train),
    }
    if config.eval_episodes:
        say(f"warm start evaluation: {config.eval_episodes} sampled episodes")
        result = asyncio.run(
            evaluate(
                net,
                config.env_id,
                config.eval_episodes,
                template,
                temperature=1.0,
                seed=config.seed + 1,
                max_turns=config.max_turns,
                max_tokens=config.max_tokens,
                max_new_tokens=config.max_new_tokens,
                system_prompt=config.system_prompt,
                concurrency=min(config.concurrency, 128) if config.concurrency > 1 else 128,
                env_kwargs=config.env_kwargs,
            )
        )
        metrics["eval"] = asdict(result)
        say(f"warm start evaluation: mean reward {result.mean_reward:.3f}")
    out = save_model(net, out_dir)
    (out / SFT_METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return metrics
