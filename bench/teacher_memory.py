"""Peak memory of distillation with several teachers and one resident (`trainer.teachers`).

Each scenario runs in a fresh interpreter, which scores and trains 3 steps on one batch
whose turns ask three skills, then reports its peak resident set (`VmHWM`):

    base       torch and the trainer imported, nothing built: the interpreter's share
    one        the student and ONE teacher that scores every turn
    three/1    three teachers, one per skill, at most one resident (LRU, dropped)
    three/3    three teachers, all resident (what residency saves)

Printed: each peak, each above `base`, and the ratios `three/1 : one` (the bound the
Teacher Manager promises is 1.2: student + one teacher + 20%) and `three/3 : one`.
The teachers are made large next to the interpreter (8 layers x 768, about 57M
parameters, 227 MB each in fp32) so the model memory, not the runtime, decides.

    python -m bench.teacher_memory [--layers 8 --hidden 768]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKILLS = ("mirror", "shift", "third")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def scenario(name: str, teachers_dir: Path) -> dict[str, float]:
    import asyncio

    from agentflow.modeling import ModelInit, build_model
    from agentflow.run_config import DistillConfig, TeacherConfig
    from agentflow.tokenization import ByteTokenizer
    from trainer.algorithms import AlgorithmConfig, DistillLoss
    from trainer.backends.torch_backend import TorchPolicy
    from trainer.teachers import TeacherManager

    if name == "base":
        return {"peak_mb": peak_rss_mb()}
    from tests.unit.trainer.test_teachers import relay_trajectory

    student = TorchPolicy(build_model(ModelInit(layers=2, hidden=128, heads=4), seed=0))
    paths = {s: str(teachers_dir / s) for s in SKILLS}
    if name == "one":
        configs = [TeacherConfig(name="all", path=paths["mirror"], tags=list(SKILLS))]
        resident = 1
    else:
        configs = [TeacherConfig(name=s, path=paths[s], tags=[s]) for s in SKILLS]
        resident = 1 if name == "three/1" else 3
    tokenizer = ByteTokenizer()
    distill = DistillConfig(
        route="turn",
        rule="agentflow.turn_rules:command_word",
        estimator="full",
        max_resident=resident,
    )
    manager = TeacherManager(
        configs, distill, decode=lambda ids: tokenizer.decode(ids, skip_special=True)
    )
    batch = [
        relay_trajectory(
            [f"mirror {i:03d}", f"right. shift {i:03d}", f"right. third {i:03d}"],
            [f"{i:03d}"[::-1], f"{i + 111:03d}", "0"],
        )
        for i in range(16)
    ]
    loss = DistillLoss(rl=False, estimator="full")

    async def steps() -> dict[str, float]:
        metrics: dict[str, float] = {}
        for _ in range(3):
            scores = await manager.score(batch)
            metrics = student.train_step(
                batch, [0.0] * len(batch), AlgorithmConfig(), teacher=scores, distill=loss
            )
            metrics.update(scores.metrics)
        await manager.close()
        return metrics

    metrics = asyncio.run(steps())
    swaps = sum(v for k, v in metrics.items() if k.endswith("/swaps"))
    return {
        "peak_mb": peak_rss_mb(),
        "resident_peak": metrics["teachers_resident_peak"],
        "swaps": swaps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--teachers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(scenario(args.scenario, Path(args.teachers))))
        return

    from agentflow.modeling import ModelInit, build_model, save_model

    init = ModelInit(layers=args.layers, hidden=args.hidden, heads=args.hidden // 64)
    with tempfile.TemporaryDirectory() as tmp:
        teachers = Path(tmp)
        size_mb = 0.0
        for seed, skill in enumerate(SKILLS):
            model = build_model(init, seed=seed)
            size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            save_model(model, teachers / skill)
            del model
        results = {}
        for name in ("base", "one", "three/1", "three/3"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.teacher_memory",
                    "--scenario",
                    name,
                    "--teachers",
                    str(teachers),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results["base"]["peak_mb"]
    print(f"teacher: {args.layers} layers x {args.hidden}, {size_mb:.0f} MB of parameters each")
    print(f"{'scenario':<10} {'peak MB':>9} {'above base':>11} {'resident':>9} {'swaps':>6}")
    for name, r in results.items():
        print(
            f"{name:<10} {r['peak_mb']:>9.0f} {r['peak_mb'] - base:>11.0f} "
            f"{r.get('resident_peak', 0):>9.0f} {r.get('swaps', 0):>6.0f}"
        )
    one = results["one"]["peak_mb"]
    for name in ("three/1", "three/3"):
        peak = results[name]["peak_mb"]
        print(
            f"{name} : one = {peak / one:.3f} (whole process), "
            f"{(peak - base) / (one - base):.3f} (above base)"
        )


if __name__ == "__main__":
    main()
