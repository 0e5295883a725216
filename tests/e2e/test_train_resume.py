"""`agentflow train` end to end: killed mid-run, the same command resumes from the last
checkpoint, and no trajectory is lost or trained twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIG = """
name = "resume-test"
seed = 3
[model]
init = {{ layers = 1, hidden = 32, heads = 2, max_context = 512 }}
[engine]
type = "local"
max_batch_size = 32
[[envs]]
id = "agentflow/guess-number-v0"
max_concurrency = 32
[agent]
max_turns = 4
max_new_tokens = 6
[rollout]
group_size = 4
max_staleness = 1
[trainer]
batch_episodes = 8
steps = 8
checkpoint_every = 3  # more steps than the staleness bound: admission must not wait on acks
run_dir = "{run_dir}"
"""


def _train(config: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "trainer.cli", "train", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _rows(metrics: Path) -> list[dict[str, float]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def test_a_killed_run_resumes_and_trains_each_trajectory_once(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "resume-test"
    metrics = run_dir / "metrics.jsonl"

    first = _train(config)
    deadline = time.monotonic() + 180
    while len(_rows(metrics)) < 4:  # past the checkpoint at step 3, before step 6's
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "the first run made no progress"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    killed_at = len(_rows(metrics))

    second = _train(config)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output
    assert "resumed from" in output and "step-00000003" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 8

    rows = _rows(metrics)  # a re-run step's first row was dropped at the resume
    assert [int(r["step"]) for r in rows] == list(range(1, 9)) and killed_at >= 4
    trained = sum(int(r["trajectories"]) for r in rows)
    ids = [i for r in rows for i in r["trajectory_ids"]]
    assert len(ids) == len(set(ids)) == trained  # each trained trajectory in one row
    with sqlite3.connect(run_dir / "agentflow.db") as db:
        statuses = dict(db.execute("SELECT status, COUNT(*) FROM trajectories GROUP BY status"))
        served = dict(db.execute("SELECT times_served, COUNT(*) FROM trajectories GROUP BY 1"))
    assert "leased" not in statuses  # nothing stuck with the dead trainer
    assert statuses.get("consumed", 0) == trained  # each trained batch counted exactly once
    assert set(served) <= {0, 1}  # no trajectory trained twice
