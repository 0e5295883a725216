"""`bench/browser_env.py` at a tiny size: every path plays its episodes to reward 1, the
warm pool makes no context while the clock runs, and the report has a row per
concurrency. Timings are printed, never checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_the_browser_bench_runs_every_path() -> None:
    done = subprocess.run(
        [sys.executable, "bench/browser_env.py", "--episodes", "10", "--cold-episodes", "2",
         "--concurrency", "1", "2", "--no-screenshots"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for path in ("warm", "fresh", "cold"):
        rows = [line for line in lines if line.startswith(f"{path} ")]
        assert len(rows) == 2, done.stdout
        assert all("success 1.00" in row for row in rows), done.stdout
    made = [int(m) for m in re.findall(r"^warm .*contexts made (\d+)$", done.stdout, re.M)]
    assert len(made) == 2 and max(made) <= 2, done.stdout  # warmed before the clock (fresh: 10)
    table = lines[lines.index("concurrency | warm eps/s | fresh eps/s | cold eps/s | warm/cold") :]
    assert [row.split("|")[0].strip() for row in table[1:]] == ["1", "2"]
