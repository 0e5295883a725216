"""RTPO against trajectory-level and turn-level GRPO, at equal samples and equal updates.

The question (docs/credit.md): does RTPO's per-turn credit (sparse reverse trees, one
update per turn depth, deepest first) beat trajectory-level GRPO given as many optimizer
steps, on envs where trajectory-level credit is noisy? Per env, one shared warm start
(supervised on noisy-oracle episodes), then every arm trains the same number of steps
from it, with about the same number of trajectories per step (re-rolls included):

    grpo            GRPO, one optimizer step per batch (the reference)
    grpo_k          GRPO, K optimizer steps per batch (K = RTPO's turn depths)
    turn_grpo_k     turn-level GRPO (returns-to-go per turn position), K steps
    rtpo            RTPO: 1 re-roll per chosen turn, K steps (one per depth, deepest first)
    rtpo_joint      ablation: RTPO's trees and advantages, K steps over all depths mixed
                    (`rtpo.update = "joint"` with K minibatches) instead of depth by depth
    rtpo_b2         ablation: 2 re-rolls per chosen turn (`rtpo.branches = 2`)

The envs (`--envs`): `long-vault` (7 policy turns, noisy dial rewards), `slip-vault`
(stochastic slips, jams and luck), `recall-vault` (dials answered against the agent's own
key), and two existing multi-turn families as sanity checks: `tictactoe` (TextArena's game
against a random opponent, on the compact board view) and `guess-number`; and `vault`
(the original three-turn env).

Each run is `agentflow train` in its own process (`--jobs` at once). Printed per env: the
warm start's and the oracle's return (400 episodes), the threshold (halfway from the
warm start to the oracle), and per arm over the seeds: the final model's return and
success on 400 sampled episodes (mean and spread), the steps and wall seconds until the
training reward (a 3-step moving mean) first reaches the threshold, and the ratios of
RTPO and its ablations against `grpo_k`. A JSON file of everything lands in `--out`.

    python -m bench.rtpo --envs long-vault slip-vault recall-vault guess-number \\
        --seeds 0 1 2 --steps 30 --jobs 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvCase:
    """One env of the study and the budgets its episodes need."""

    id: str
    max_turns: int  # the agent's turn budget; RTPO's turn depths (K) on a full episode
    max_tokens: int  # the context budget of an episode
    rtpo_group: int  # RTPO's episodes per task (its re-rolls fill the rest of a group)
    branch_turns: int  # turns after the first each RTPO episode re-rolls from
    max_new_tokens: int = 4
    kwargs: tuple[tuple[str, str], ...] = ()  # the env's arguments (strings)


ENVS: dict[str, EnvCase] = {
    "long-vault": EnvCase("agentflow/long-vault-v0", 7, 320, 3, 3),
    "slip-vault": EnvCase("agentflow/slip-vault-v0", 4, 192, 4, 2),
    "recall-vault": EnvCase("agentflow/recall-vault-v0", 3, 160, 4, 2),
    "guess-number": EnvCase("agentflow/guess-number-v0", 5, 320, 4, 2, max_new_tokens=6),
    "vault": EnvCase("agentflow/vault-v0", 3, 160, 4, 2),
    # TextArena's game against a random opponent, on the compact board line.
    "tictactoe": EnvCase("textarena/TicTacToe-v0", 6, 512, 4, 2, kwargs=(("view", "board"),)),
}

# The default study: the three envs built for it and one existing family.
STUDY = ("long-vault", "slip-vault", "recall-vault", "tictactoe")


@dataclass(frozen=True)
class Arm:
    algorithm: str
    k_steps: bool  # K optimizer steps per batch (RTPO's reverse update takes them by depth)
    branches: int = 0
    update: str = "reverse"


ARMS: dict[str, Arm] = {
    "grpo": Arm("grpo", k_steps=False),
    "grpo_k": Arm("grpo", k_steps=True),
    "turn_grpo_k": Arm("turn_grpo", k_steps=True),
    "rtpo": Arm("rtpo", k_steps=True, branches=1),
    "rtpo_joint": Arm("rtpo", k_steps=True, branches=1, update="joint"),
    "rtpo_b2": Arm("rtpo", k_steps=True, branches=2),
}
GRPO_GROUP = 12  # episodes per task for the GRPO arms
MODEL = "init = { layers = 2, hidden = 128, heads = 4, max_context = 512 }"

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
kwargs = {{ {kwargs} }}
[agent]
max_turns = {max_turns}
max_tokens = {max_tokens}
max_new_tokens = {max_new_tokens}
temperature = 1.0
[rollout]
group_size = {group_size}
max_staleness = 1
max_concurrency = 256
park_after_s = 60.0
[trainer]
algorithm = "{algorithm}"
decoupled = false
batch_episodes = {batch}
minibatches = {minibatches}
lr = 2e-4
steps = {steps}
checkpoint_every = {steps}
threads = 1
run_dir = "{run_dir}"
{rtpo}
"""

WARM_START = """
[warm_start]
enabled = true
n_episodes = {episodes}
p_oracle = 0.3
epochs = 2
batch_size = 32
lr = 1e-3
eval_episodes = 0
"""


def group_size(case: EnvCase, arm: Arm) -> int:
    """Episodes per task: 12 for the GRPO arms; RTPO's re-rolls make up the rest of its
    groups (one re-roll per chosen turn: `rtpo_group` episodes; two: half as many)."""
    if arm.algorithm != "rtpo":
        return GRPO_GROUP
    return case.rtpo_group if arm.branches == 1 else max(2, case.rtpo_group // 2)


def config_text(
    case: EnvCase,
    arm: Arm,
    *,
    name: str,
    seed: int,
    steps: int,
    batch: int,
    model: str,
    run_dir: Path,
) -> str:
    """The run's TOML: same model, budgets, learning rate and trajectories per step for
    every arm; K optimizer steps per batch for every arm but `grpo`."""
    rtpo = ""
    minibatches = case.max_turns if arm.k_steps else 1
    if arm.algorithm == "rtpo":
        # The reverse update already takes one step per depth: no minibatches on top.
        minibatches = case.max_turns if arm.update == "joint" else 1
        rtpo = (
            f"[rtpo]\nbranches = {arm.branches}\nbranch_turns = {case.branch_turns}\n"
            f'update = "{arm.update}"\n'
        )
    return BASE.format(
        name=name,
        seed=seed,
        model=model,
        env=case.id,
        kwargs=", ".join(f'{k} = "{v}"' for k, v in case.kwargs),
        max_turns=case.max_turns,
        max_tokens=case.max_tokens,
        max_new_tokens=case.max_new_tokens,
        group_size=group_size(case, arm),
        algorithm=arm.algorithm,
        batch=batch,
        minibatches=minibatches,
        steps=steps,
        run_dir=run_dir,
        rtpo=rtpo,
    )


def _agentflow(*args: str) -> str:
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


def curve(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each step's training reward and the wall seconds since the run started, from its
    metrics rows."""
    by_step = {int(r["step"]): r for r in rows}
    return [
        {"reward": float(by_step[s]["reward"]), "time": float(by_step[s].get("time", 0.0))}
        for s in sorted(by_step)
    ]


def first_reaching(rewards: list[float], threshold: float, window: int = 3) -> int | None:
    """The first step (1-based) whose trailing `window`-step mean reward reaches
    `threshold`, or None."""
    for i in range(len(rewards)):
        recent = rewards[max(0, i - window + 1) : i + 1]
        if len(recent) == window and sum(recent) / window >= threshold:
            return i + 1
    return None


def evaluate_model(
    case: EnvCase, model: Path | None, episodes: int, seed: int = 0
) -> dict[str, float]:
    """Mean return and success rate of `model` (None: the env's oracle) over `episodes`
    sampled episodes of the env."""
    from agentflow.tokenization import ByteTokenizer
    from agentflow.tokenization.chat import ByteChatTemplate

    if model is None:
        return asyncio.run(_oracle_return(case, episodes, seed))
    from transformers.utils import logging as hf_logging

    from agentflow.modeling import load_model
    from trainer.evaluation import evaluate

    hf_logging.disable_progress_bar()
    metrics = asyncio.run(
        evaluate(
            load_model(model),
            case.id,
            episodes,
            ByteChatTemplate(ByteTokenizer()),
            seed=seed,
            max_turns=case.max_turns,
            max_tokens=case.max_tokens,
            max_new_tokens=case.max_new_tokens,
            env_kwargs={case.id: dict(case.kwargs)} if case.kwargs else None,
        )
    )
    return {"return": metrics.mean_reward, "success": metrics.success_rate}


async def _oracle_return(case: EnvCase, episodes: int, seed: int) -> dict[str, float]:
    from envs import registry

    oracle = registry.oracle(case.id)
    env = registry.make(case.id, **dict(case.kwargs))
    total, successes = 0.0, 0
    try:
        for k in range(episodes):
            result = await env.reset(seed=seed * 100_003 + k)
            history = [result.observation]
            while not (result.terminated or result.truncated):
                result = await env.step(oracle(history))
                history.append(result.observation)
                total += result.reward
            successes += bool(result.info.get("success"))
    finally:
        await env.close()
    return {"return": total / episodes, "success": successes / episodes}


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(
    arms: list[str], runs: dict[str, list[dict[str, Any]]], threshold: float
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        seeds = runs[arm]
        reached = [first_reaching([c["reward"] for c in r["curve"]], threshold) for r in seeds]
        seconds = [
            r["curve"][step - 1]["time"] for r, step in zip(seeds, reached, strict=True) if step
        ]
        out[arm] = {
            "return": spread([r["final"]["return"] for r in seeds]),
            "success": spread([r["final"]["success"] for r in seeds]),
            "steps_to_threshold": reached,
            "seconds_to_threshold": seconds,
            "wall_seconds": spread([r["wall_seconds"] for r in seeds]),
            "trajectories_per_step": spread([r["trajectories_per_step"] for r in seeds]),
        }
    return out


def print_env(name: str, env: dict[str, Any], arms: list[str]) -> None:
    print(
        f"\n## {name} ({env['id']}): warm start {env['warm']['return']:.3f}, oracle "
        f"{env['oracle']['return']:.3f}, threshold {env['threshold']:.3f}"
    )
    print(
        f"{'arm':>12} {'return':>15} {'success':>15} {'steps to thr.':>16} "
        f"{'s to thr.':>12} {'traj/step':>9} {'run s':>7}"
    )
    table = env["arms"]
    for arm in arms:
        row = table[arm]
        steps = ",".join("-" if s is None else str(s) for s in row["steps_to_threshold"])
        secs = row["seconds_to_threshold"]
        print(
            f"{arm:>12} {row['return'][0]:>8.3f} ±{row['return'][1]:.3f} "
            f"{row['success'][0]:>8.3f} ±{row['success'][1]:.3f} {steps:>16} "
            f"{(statistics.fmean(secs) if secs else math.nan):>12.0f} "
            f"{row['trajectories_per_step'][0]:>9.1f} {row['wall_seconds'][0]:>7.0f}"
        )
    base = table.get("grpo_k")
    if base is not None:
        for arm in (a for a in arms if a.startswith("rtpo") or a == "grpo"):
            ratio = table[arm]["return"][0] / max(base["return"][0], 1e-9)
            gap = table[arm]["return"][0] - base["return"][0]
            noise = math.hypot(table[arm]["return"][1], base["return"][1])
            print(f"{arm} / grpo_k: return x{ratio:.3f} ({gap:+.3f}; seeds' spread ±{noise:.3f})")


def compare(row: dict[str, Any], base: dict[str, Any], n: int) -> tuple[float, float, str]:
    """`row`'s final return against `base`'s over `n` seeds each: the gap of the means,
    its standard error, and a verdict: ahead or behind beyond two standard errors (about
    95% for a normal spread), else level."""
    gap = row["return"][0] - base["return"][0]
    error = math.sqrt((row["return"][1] ** 2 + base["return"][1] ** 2) / max(n, 1))
    verdict = "level" if abs(gap) <= 2 * error else "ahead" if gap > 0 else "behind"
    return gap, error, verdict


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as Markdown (docs/credit.md)."""
    lines: list[str] = []
    for name, env in report["envs"].items():
        table = env["arms"]
        n = len(next(iter(table.values()))["steps_to_threshold"])
        lines += [
            f"**{name}** (`{env['id']}`): warm start {env['warm']['return']:.3f} "
            f"(success {env['warm']['success']:.3f}), oracle {env['oracle']['return']:.3f}; "
            f"threshold {env['threshold']:.3f}; {n} seeds",
            "",
            "| arm | final return | success | steps to threshold | s to threshold "
            "| trajectories/step | against grpo_k |",
            "|---|---|---|---|---|---|---|",
        ]
        base = table.get("grpo_k")
        for arm, row in table.items():
            steps = ", ".join("-" if s is None else str(s) for s in row["steps_to_threshold"])
            secs = row["seconds_to_threshold"]
            against = ""
            if base is not None and arm != "grpo_k":
                gap, error, verdict = compare(row, base, n)
                against = f"{gap:+.3f} ± {error:.3f}: {verdict}"
            lines.append(
                f"| {arm} | {row['return'][0]:.3f} ± {row['return'][1]:.3f} "
                f"| {row['success'][0]:.3f} ± {row['success'][1]:.3f} | {steps} "
                f"| {f'{statistics.fmean(secs):.0f}' if secs else '-'} "
                f"| {row['trajectories_per_step'][0]:.0f} | {against} |"
            )
        lines.append("")
    return "\n".join(lines)


def _one_run(
    out: Path,
    case_name: str,
    arm_name: str,
    seed: int,
    steps: int,
    batch: int,
    model: str,
    episodes: int,
) -> dict[str, Any]:
    case, arm = ENVS[case_name], ARMS[arm_name]
    name = f"{case_name}-{arm_name}-seed{seed}"
    config = out / f"{name}.toml"
    run_dir = out / "runs"
    config.write_text(
        config_text(
            case, arm, name=name, seed=seed, steps=steps, batch=batch, model=model, run_dir=run_dir
        )
    )
    started = time.perf_counter()
    _agentflow("train", str(config))
    wall = time.perf_counter() - started
    run = run_dir / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = run / "checkpoints" / f"step-{steps:08d}" / "model"
    result = {
        "curve": curve(rows),
        "final": evaluate_model(case, final, episodes),
        "wall_seconds": wall,
        "trajectories_per_step": statistics.fmean(float(r.get("trajectories", 0)) for r in rows),
    }
    print(f"{name}: {result['final']} in {wall:.0f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", nargs="+", choices=list(ENVS), default=list(STUDY))
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=60, help="trajectories per step")
    parser.add_argument("--warm-episodes", type=int, default=6000)
    parser.add_argument("--episodes", type=int, default=400, help="per evaluation")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--out", type=Path, default=Path("bench-rtpo"))
    parser.add_argument(
        "--report", type=Path, help="print a finished run's report.json as Markdown tables"
    )
    args = parser.parse_args()
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return
    out: Path = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "envs": {}}
    for case_name in args.envs:
        case = ENVS[case_name]
        # One warm start per env, shared by every arm and seed.
        warm = out / f"{case_name}-warm.toml"
        warm.write_text(
            config_text(
                case,
                ARMS["grpo"],
                name=f"{case_name}-warm",
                seed=0,
                steps=1,
                batch=args.batch,
                model=MODEL,
                run_dir=out / "runs",
            )
            + WARM_START.format(episodes=args.warm_episodes)
        )
        sft = out / f"{case_name}-sft"
        _agentflow("sft", str(warm), "--out", str(sft))
        warm_eval = evaluate_model(case, sft, args.episodes)
        oracle = evaluate_model(case, None, args.episodes)
        threshold = warm_eval["return"] + 0.5 * (oracle["return"] - warm_eval["return"])
        print(f"{case_name}: warm start {warm_eval}, oracle {oracle}", flush=True)
        jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
        play = functools.partial(
            _one_run,
            out,
            case_name,
            steps=args.steps,
            batch=args.batch,
            model=f'path = "{sft}"',
            episodes=args.episodes,
        )
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = list(pool.map(play, [a for a, _ in jobs], [s for _, s in jobs]))
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in args.arms}
        for (arm, _), result in zip(jobs, done, strict=True):
            runs[arm].append(result)
        report["envs"][case_name] = {
            "id": case.id,
            "case": asdict(case),
            "warm": warm_eval,
            "oracle": oracle,
            "threshold": threshold,
            "arms": summarize(args.arms, runs, threshold),
            "runs": runs,
        }
        print_env(case_name, report["envs"][case_name], args.arms)
        (out / "report.json").write_text(json.dumps(report, indent=1))
    report["machine_seconds"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
