"""`bench/burst.py` as the issue's check: ten bursts in a row, each 1,000 mixed requests
(env creates, env lists, run reads) 200 at once from one stock httpx client, with stock
clients reusing pooled connections at httpx's keep-alive edge beside them: no transport
error in any run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_ten_bursts_in_a_row_lose_no_request() -> None:
    # No client timeouts: on a loaded machine a stock client's 5 s ones are the machine's.
    command = [sys.executable, "-m", "bench.burst", "--runs", "10", "--requests", "1000"]
    command += ["--concurrency", "200", "--db", "sqlite", "--edge", "4", "--timeout", "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run 10 (" in done.stdout and "keep-alive edge: " in done.stdout, done.stdout
    assert done.stdout.count("statuses {200: 666, 201: 334}") == 10, done.stdout  # all answered
    assert "0 transport errors in 10 runs" in done.stdout, done.stdout
