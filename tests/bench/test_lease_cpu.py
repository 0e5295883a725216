"""`bench/lease_cpu.py` runs end to end on a small load: every group is leased once, the
table has both rows, and the ratios are printed (a checkout compared with itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_lease_bench_compares_two_checkouts() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "lease_cpu.py"),
            "--groups=4",
            "--group-size=2",
            "--repeat=1",
            f"--against={ROOT}",
            f"--database-url={PG_ADMIN_URL}",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "4 groups of 2, leased one group a pull" in out
    rows = [line for line in out.splitlines() if line.startswith(("| against", "| this"))]
    assert len(rows) == 2
    for row in rows:
        pull, ack = (float(cell) for cell in row.strip("|").split("|")[1:3])
        assert pull > 0 and ack > 0
    assert "ratio (against / this): pull x" in out
