"""`bench/burst.py`: one short run end to end, the keep-alive edge clients included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_run_reports_and_loses_nothing() -> None:
    # No client timeouts: on a loaded machine a stock client's 5 s ones are the machine's.
    command = [sys.executable, "-m", "bench.burst", "--runs", "1", "--requests", "30"]
    command += ["--concurrency", "10", "--db", "sqlite", "--edge", "2", "--timeout", "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run 1 (" in done.stdout and "keep-alive edge: " in done.stdout, done.stdout
    assert "0 transport errors in 1 runs" in done.stdout, done.stdout
