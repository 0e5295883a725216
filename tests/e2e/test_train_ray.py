"""`agentflow train CONFIG --ray local` end to end: a Ray cluster started for the run,
two engine actors behind the gateway, two trainer ranks as actors publishing by disk
sync, one rank killed mid-run and both started again from the newest checkpoint, and
nothing of the cluster left once the command returns.

The cluster's processes are told apart from any other Ray cluster on the machine (another
test's) by a tag in their environment, which every process the command starts inherits:
Ray's own daemons and its actors alike."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import TAG_ENV, tagged

pytest.importorskip("ray")

# Its own deadlines (a third step, then the restarted ranks) come before the suite's.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

STEPS = 6

CONFIG = """
name = "placed"
seed = 0
[model]
init = { layers = 1, hidden = 32, heads = 2, max_context = 256 }
[engine]
type = "local"
max_batch_size = 32
[[envs]]
id = "agentflow/guess-number-v0"
[agent]
max_turns = 3
max_tokens = 256
max_new_tokens = 8
[rollout]
group_size = 4
max_staleness = 1
max_concurrency = 32
[trainer]
batch_episodes = 16
steps = 6
checkpoint_every = 2
threads = 1
ranks = 2
run_dir = "runs"
[warm_start]
enabled = false
[placement]
ray = "local"
engines = 2
engine_cpus = 0.5
trainer_cpus = 0.5
"""


def _command(tag: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", TAG_ENV: tag}


def test_the_run_trains_with_engines_and_ranks_as_actors_through_a_rank_kill(
    tmp_path: Path,
) -> None:
    """One run: two engine actors, two trainer ranks; after the third step one rank is
    killed with SIGKILL, both ranks start again from the newest checkpoint, and the run
    trains to its last step."""
    (tmp_path / "placed.toml").write_text(CONFIG)
    run_dir = tmp_path / "runs" / "placed"
    metrics = run_dir / "metrics.jsonl"
    tag = uuid.uuid4().hex
    with subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "train", "placed.toml"],
        cwd=tmp_path,
        env=_command(tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as command:
        try:
            # Generous: Ray's start and two engine actors share two cores with other tests.
            deadline = time.monotonic() + 600
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
                assert command.poll() is None, command.stderr.read() if command.stderr else ""
                if time.monotonic() > deadline:
                    command.kill()
                    _, err = command.communicate()
                    raise AssertionError(f"no third step in 600 s; it said:\n{err[-3000:]}")
                time.sleep(0.2)
            trainers = [pid for pid, args in tagged(tag).items() if "ray::TrainerRank" in args]
            assert len(trainers) == 2  # both ranks are actors, neither this process
            os.kill(trainers[0], signal.SIGKILL)
            out, err = command.communicate(timeout=600)
        finally:
            if command.poll() is None:
                command.kill()
    assert command.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["trainer_restarts"] == 1
    assert summary["last_step"] == STEPS
    assert summary["placement"]["engines"] == 2 and summary["placement"]["live_engines"] == 2
    assert "starting the ranks again from the newest checkpoint" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Steps after the newest checkpoint may be trained again after the kill.
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))
    assert all(r["ranks"] == 2 for r in rows)  # both trainer actors trained each batch
    assert (run_dir / "checkpoints").is_dir()
    with sqlite3.connect(run_dir / "agentflow.db") as db:
        versions = db.execute(
            "SELECT version, uri FROM weight_versions ORDER BY version"
        ).fetchall()
        turns = db.execute("SELECT count(*) FROM turns WHERE kind = 'policy'").fetchone()[0]
    # Each step's weights went to the engine actors from the run directory; the steps
    # trained again after the kill published versions of their own (versions only rise).
    numbers = [v for v, _ in versions]
    assert len(numbers) >= STEPS and numbers == sorted(set(numbers))
    assert all(str(run_dir / "weights") in uri for _, uri in versions)
    assert turns > 0
    # Ray's worker processes end on their own once the raylet has gone, a moment after
    # the command returns (longer on a loaded machine): wait for them, not for ever.
    deadline = time.monotonic() + 30
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tagged(tag) == {}, "the cluster the command started is gone"
