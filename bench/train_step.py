"""Trainer step cost against a plain teacher-forced step, and weight sync time by model size.

Both sections run in this one process and print ratios (machine speed varies between
runs; figures measured side by side do not):

1. `TorchPolicy.train_step` (batching, the no-grad pass when one is needed, decoupled
   PPO loss, backward, clip, AdamW) against a plain forward + cross-entropy + backward +
   clip + AdamW over the very same micro-batches (built beforehand, untimed), same model
   size and tokens. Guess-number-like trajectories: a ~70-token prompt, then 3-6 turns of
   a short policy reply and env feedback, 130-270 tokens each (about 200 on
   average), 128 per batch (16 groups of 8). Target: trainer overhead <= 25%.
2. `trainer.weights.WeightPublisher` publishing the trainer's state dict to a
   `LocalEngine`, `inprocess` and `disk`, for growing model sizes.

    python bench/train_step.py [--threads 1] [--reps 4] [--skip-sync] [--max-sync-hidden 768]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

import torch

from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit, build_model
from agentflow.types import NO_VERSION, Trajectory
from trainer.algorithms import AlgorithmConfig, group_advantages
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
from trainer.batching import BatchingConfig, MicroBatch, build_microbatches

BUDGET = 16384  # tokens per micro-batch, padding included


def guess_number_trajectory(rng: random.Random, group: str) -> Trajectory:
    tokens: list[int] = []
    mask: list[int] = []

    def segment(n: int, policy: int) -> None:
        tokens.extend(rng.randrange(3, 259) for _ in range(n))
        mask.extend([policy] * n)

    segment(rng.randrange(60, 80), 0)  # system prompt and task
    turns = rng.randrange(3, 7)
    for k in range(turns):
        segment(rng.randrange(8, 20), 1)  # "<guess>7</guess>" and the end-of-turn token
        if k < turns - 1:
            segment(rng.randrange(14, 24), 0)  # "higher" / "lower" wrapped in the template
    found = rng.random() < 0.5
    return Trajectory(
        id=uuid.uuid4(),
        run_id=None,
        episode_id=uuid.uuid4(),
        group_id=group,
        leaf_turn_id=uuid.uuid4(),
        reward=1 - 0.1 * (turns - 1) if found else 0.0,
        status="ready",
        times_served=0,
        min_weight_version=0,
        created_at=datetime.now(UTC),
        turn_ids=(),
        turn_starts=(),
        token_ids=tuple(tokens),
        logprobs=tuple(-2 * rng.random() if m else 0.0 for m in mask),
        loss_mask=tuple(mask),
        weight_versions=tuple(0 if m else NO_VERSION for m in mask),
    )


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, mbs: list[MicroBatch]
) -> None:
    """The least a step can do: forward, masked cross-entropy, backward, clip, AdamW."""
    total = sum(mb.num_policy_tokens for mb in mbs)
    optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        logits = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=mb.attention_mask,
            use_cache=False,
        ).logits
        loss = torch.nn.functional.cross_entropy(
            logits[mb.loss_mask].float(), mb.targets[mb.loss_mask], reduction="sum"
        )
        (loss / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def bench_train_step(reps: int) -> None:
    init = ModelInit(layers=4, hidden=128)
    rng = random.Random(0)
    trajs = [guess_number_trajectory(rng, f"task{i // 8}") for i in range(128)]
    adv = group_advantages([t.reward or 0.0 for t in trajs], [t.group_id for t in trajs])
    tokens = sum(len(t.token_ids) for t in trajs)
    base = build_model(init, seed=0)
    print(
        f"== train step: {init.layers} layers x {init.hidden}, {len(trajs)} trajectories, "
        f"{tokens} tokens ({min(len(t.token_ids) for t in trajs)}-"
        f"{max(len(t.token_ids) for t in trajs)} each), micro-batch budget {BUDGET}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    layouts = {
        "padded": BatchingConfig(max_tokens_per_microbatch=BUDGET),
        "packed": BatchingConfig(
            max_tokens_per_microbatch=BUDGET, layout="packed", max_row_tokens=1024
        ),
    }
    variants: dict[str, tuple[str, AlgorithmConfig | None]] = {
        "plain fwd+bwd+step (padded)": ("padded", None),
        "plain fwd+bwd+step (packed)": ("packed", None),
        "train_step padded, proximal auto": ("padded", AlgorithmConfig()),
        "train_step padded, proximal recompute": ("padded", AlgorithmConfig(proximal="recompute")),
        "train_step packed, proximal auto": ("packed", AlgorithmConfig()),
    }
    runners: dict[str, Callable[[], object]] = {}
    for name, (layout, algo) in variants.items():
        model = copy.deepcopy(base)
        if algo is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            mbs = build_microbatches(trajs, adv, layouts[layout])
            runners[name] = functools.partial(plain_step, model, opt, mbs)
        else:
            policy = TorchPolicy(model, TorchBackendConfig(lr=1e-4, batching=layouts[layout]))
            runners[name] = functools.partial(policy.train_step, trajs, adv, algo)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        run()  # warm-up
    for _ in range(reps):  # interleaved, so drifting machine speed hits all alike
        for name, run in runners.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    # Other processes on the machine slow some runs: each variant is compared with the
    # plain step of the same round (paired ratios), and the median ratio is reported.
    plain = times["plain fwd+bwd+step (padded)"]
    print(
        f"  {'':40s} {'best':>10s} {'tokens/s':>9s}  "
        f"{'vs plain padded (median of paired ratios)':>42s}"
    )
    for name, ts in times.items():
        best = min(ts)
        ratio = statistics.median(t / p for t, p in zip(ts, plain, strict=True))
        print(
            f"  {name:40s} {best * 1000:7.1f} ms {tokens / best:9.0f}  {(ratio - 1) * 100:+41.1f}%"
        )
    policy_m = TorchPolicy(copy.deepcopy(base), TorchBackendConfig(batching=layouts["padded"]))
    m = policy_m.train_step(trajs, adv)
    print(
        f"  (train_step metrics: {int(m['microbatches'])} micro-batches, batching "
        f"{m['batching_seconds'] * 1000:.1f} ms, clip_frac {m['clip_frac']:.3f}, "
        f"max_is_weight {m['max_is_weight']:.2f})"
    )


async def bench_weight_sync(reps: int, max_hidden: int) -> None:
    from trainer.weights import WeightPublisher

    print("== weight sync to one LocalEngine (median of reps)")
    sizes = [(4, 128, 4), (4, 256, 4), (8, 512, 8), (12, 768, 12)]
    for layers, hidden, heads in sizes:
        if hidden > max_hidden:
            continue
        init = ModelInit(layers=layers, hidden=hidden, heads=heads)
        model = build_model(init, seed=0)
        policy = TorchPolicy(model)
        params = sum(p.numel() for p in model.parameters())
        engine = LocalEngine.from_init(init, seed=1)
        await engine.start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                modes: tuple[Literal["inprocess", "disk"], ...] = ("inprocess", "disk")
                for mode in modes:
                    publisher = WeightPublisher(
                        mode,
                        [engine],
                        tmp if mode == "disk" else None,
                        config=model.config,
                        initial_version=engine.weight_version,
                    )
                    reports = []
                    for _ in range(reps):
                        version = publisher.published_version + 1
                        reports.append(await publisher.publish(policy.state_dict(), version))
                    seconds = statistics.median(r.seconds for r in reports)
                    write = statistics.median(r.write_seconds for r in reports)
                    mb = reports[0].bytes / 1e6
                    print(
                        f"  {layers:2d} x {hidden:4d} ({params / 1e6:6.1f}M params, {mb:7.1f} MB)"
                        f"  {mode:9s} {seconds * 1000:8.1f} ms (write {write * 1000:7.1f} ms)"
                        f"  {mb / seconds:7.0f} MB/s"
                    )
        finally:
            await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--max-sync-hidden", type=int, default=768)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_train_step(args.reps)
    if not args.skip_sync:
        asyncio.run(bench_weight_sync(args.reps, args.max_sync_hidden))


if __name__ == "__main__":
    main()
