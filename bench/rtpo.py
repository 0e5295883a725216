"""RTPO against turn-level and trajectory-level GRPO on the credit-assignment env.

`agentflow/vault-v0`: the first reply (the key) decides the largest reward, paid only at
the end; the two dial turns after it earn small rewards of their own (envs/builtin/vault.py).
Every run starts from the same warm start (made once here) and trains the same number of
steps on the same number of trajectories per step, RTPO's re-rolls included:

    grpo        12 episodes per task, 8 tasks per step      = 96 trajectories
    turn_grpo   12 episodes per task, 8 tasks per step      = 96 trajectories
    rtpo         4 episodes per task, each re-rolled once from each of its 2 dial turns
                 (3 trajectories per episode), 8 tasks      = 96 trajectories

Each run is `agentflow train` in its own process. Printed: the training reward by step
(mean over seeds; RTPO's includes its re-rolls), then each final model evaluated on 400
sampled episodes (mean return, key right, dials right), and the ratios against GRPO.

    python -m bench.rtpo [--seeds 0 1] [--steps 40] [--variants ...] [--out bench-rtpo]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# name: (trainer.algorithm, episodes per task, extra [trainer] lines)
VARIANTS: dict[str, tuple[str, int, str]] = {
    "grpo": ("grpo", 12, ""),
    # RTPO takes one optimizer step per turn depth (3 here): GRPO with as many steps per
    # batch tells more updates from better credit.
    "grpo_3steps": ("grpo", 12, "minibatches = 3"),
    "turn_grpo": ("turn_grpo", 12, ""),
    "rtpo": ("rtpo", 4, ""),
}
ENV = "agentflow/vault-v0"

BASE = """
name = "{name}"
seed = {seed}
[model]
{model}
[engine]
type = "local"
max_batch_size = 128
[[envs]]
id = "{env}"
max_concurrency = 256
[agent]
max_turns = 3
max_tokens = 128
max_new_tokens = 4
temperature = 1.0
[rollout]
group_size = {group_size}
max_staleness = 1
max_concurrency = 256
park_after_s = 60.0
[trainer]
algorithm = "{algorithm}"
decoupled = false
batch_episodes = 96
lr = 2e-4
steps = {steps}
checkpoint_every = {steps}
threads = 1
run_dir = "{run_dir}"
{trainer_extra}
{extra}
"""

WARM_START = """
[warm_start]
enabled = true
n_episodes = 6000
p_oracle = 0.3
epochs = 2
batch_size = 32
lr = 1e-3
eval_episodes = 0
"""


def _config(out: Path, name: str, variant: str, seed: int, steps: int, model: str) -> Path:
    algorithm, group_size, trainer_extra = VARIANTS[variant]
    rtpo = algorithm == "rtpo"
    text = BASE.format(
        name=name,
        seed=seed,
        model=model,
        env=ENV,
        group_size=group_size,
        algorithm=algorithm,
        steps=steps,
        run_dir=out / "runs",
        trainer_extra=trainer_extra,
        extra="[rtpo]\nbranches = 1\n" if rtpo else "",
    )
    path = out / f"{name}.toml"
    path.write_text(text)
    return path


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"agentflow {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {int(r["step"]): float(r["reward"]) for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def _evaluate(model: Path, episodes: int) -> dict[str, float]:
    """Mean return and the key's and dials' hit rates, from the model's own episodes."""
    import asyncio

    from transformers.utils import logging as hf_logging

    from agentflow.modeling import load_model
    from agentflow.tokenization import ByteTokenizer
    from agentflow.tokenization.chat import ByteChatTemplate
    from trainer.evaluation import evaluate

    hf_logging.disable_progress_bar()
    metrics = asyncio.run(
        evaluate(
            load_model(model),
            ENV,
            episodes,
            ByteChatTemplate(ByteTokenizer()),
            max_turns=3,
            max_tokens=128,
            max_new_tokens=4,
        )
    )
    return {"return": metrics.mean_reward, "key": metrics.success_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("bench-rtpo"))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    algorithms: tuple[str, ...] = tuple(args.variants)
    out: Path = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    # One warm start for every run: made by the first config, then given as model.path.
    init = "init = { layers = 2, hidden = 128, heads = 4, max_context = 256 }"
    warm = _config(out, "warm", "grpo", 0, 1, init)
    warm.write_text(warm.read_text() + WARM_START)
    _run("sft", str(warm), "--out", str(out / "sft"))
    model = f'path = "{out / "sft"}"'

    curves: dict[str, list[list[float]]] = {a: [] for a in algorithms}
    finals: dict[str, list[dict[str, float]]] = {a: [] for a in algorithms}
    for seed in args.seeds:
        for algorithm in algorithms:
            name = f"{algorithm}-seed{seed}"
            config = _config(out, name, algorithm, seed, args.steps, model)
            _run("train", str(config))
            run_dir = out / "runs" / name
            curves[algorithm].append(_rewards(run_dir))
            final = run_dir / "checkpoints" / f"step-{args.steps:08d}" / "model"
            finals[algorithm].append(_evaluate(final, args.episodes))
            print(f"{name}: final {finals[algorithm][-1]}", flush=True)

    print(f"\ntraining reward by step (mean of seeds {args.seeds}; rtpo's includes re-rolls)")
    print(f"{'step':>5} " + " ".join(f"{a:>12}" for a in algorithms))
    for step in range(0, args.steps, max(1, args.steps // 10)):
        cells = [sum(c[step] for c in curves[a]) / len(curves[a]) for a in algorithms]
        print(f"{step + 1:>5} " + " ".join(f"{v:>12.3f}" for v in cells))
    print(f"\nfinal models, {args.episodes} sampled episodes each (mean of seeds)")
    print(f"{'':>12} {'return':>8} {'key':>8}")
    mean = {
        a: {k: sum(f[k] for f in finals[a]) / len(finals[a]) for k in ("return", "key")}
        for a in algorithms
    }
    for a in algorithms:
        print(f"{a:>12} {mean[a]['return']:>8.3f} {mean[a]['key']:>8.3f}")
    if "rtpo" in mean:
        for a in (a for a in algorithms if a != "rtpo"):
            print(
                f"rtpo / {a}: return {mean['rtpo']['return'] / max(mean[a]['return'], 1e-9):.3f}"
                f", key {mean['rtpo']['key'] / max(mean[a]['key'], 1e-9):.3f}"
            )


if __name__ == "__main__":
    main()
