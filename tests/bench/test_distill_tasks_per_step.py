"""`bench/distill_tasks_per_step.py` at a tiny size, with random teachers: each setting
trains and is evaluated, and the summary has a row per setting. Nothing is learned in
two steps; what the bench measures is in docs/distillation.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentflow.modeling import ModelInit, build_model, save_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_trains_every_setting(tmp_path: Path) -> None:
    for seed, skill in enumerate(("shift", "mirror")):
        init = ModelInit(layers=1, hidden=16, heads=2, max_context=64)
        save_model(build_model(init, seed=seed), tmp_path / f"teacher-{skill}")
    done = subprocess.run(
        [sys.executable, "-m", "bench.distill_tasks_per_step", "--steps", "2", "--batch", "8",
         "--distinct", "4", "1", "--teachers", str(tmp_path / "teacher-{skill}")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for distinct in (4, 1):
        steps = [
            line for line in done.stdout.splitlines() if f"distinct {distinct:3d}  step" in line
        ]
        assert [line.split("step")[1].split()[0] for line in steps] == ["0", "2"], done.stdout
    table = done.stdout.split("distinct per skill |")[1].splitlines()[1:3]
    assert [row.split("|")[0].strip() for row in table] == ["4", "1"], done.stdout


def test_the_bench_refuses_bad_settings_and_names_a_missing_teacher(tmp_path: Path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bench.distill_tasks_per_step", "--batch", "8",
             "--teachers", str(tmp_path / "none-{skill}"), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    too_many = bench("--distinct", "5")
    assert too_many.returncode != 0 and "each must be in [1, 4]" in too_many.stderr
    missing = bench("--distinct", "4")
    assert missing.returncode != 0
    assert f"no teacher at {tmp_path / 'none-shift'}" in missing.stderr
