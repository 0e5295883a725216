"""`bench/rest_api.py`: wrk's report read right, and one short run end to end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.rest_api import ROUTES, parse_wrk

WRK_OUTPUT = """\
Running 10s test @ http://127.0.0.1:8000/v1/envs
  2 threads and 20 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    48.10ms   20.01ms 210.33ms   80.12%
    Req/Sec   208.54     40.12   290.00     70.00%
  Latency Distribution
     50%  850.00us
     75%   55.20ms
     90%   70.10ms
     99%    1.20s
  4170 requests in 10.01s, 9.21MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:    416.60
Transfer/sec:      0.92MB
"""


def test_wrk_report_is_read_in_milliseconds() -> None:
    load = parse_wrk(WRK_OUTPUT)
    assert load.rate == 416.6 and load.requests == 4170
    assert load.p50_ms == pytest.approx(0.85) and load.p99_ms == pytest.approx(1200.0)
    assert load.errors == 4 + 1 + 2


def test_an_unexpected_report_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="unexpected wrk output"):
        parse_wrk("unable to connect to 127.0.0.1:8000 Connection refused")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk")
def test_a_short_run_prints_every_route() -> None:
    script = Path(__file__).parents[2] / "bench" / "rest_api.py"
    done = subprocess.run(
        [sys.executable, str(script), "--duration", "1", "--warm-up", "0", "--envs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.splitlines()
    for route in ROUTES:
        (row,) = [line for line in table if line.split()[0] == route]
        assert len(row.split()) == 7, row
    assert "failed requests" not in done.stdout
