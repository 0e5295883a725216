"""A split trainer killed with SIGKILL at each point of a step (trained, published, its
metrics written, checkpointed, acknowledged) and started again: every step has exactly
one metrics row, in metrics.jsonl and in the gateway's API, and every trajectory the
gateway counts as trained is in exactly one row.

One real `agentflow serve` (SQLite) and one run of 4 steps with a checkpoint each step.
The crashes are chained: a trainer (tests/integration/trainer/crashing_trainer.py) dies
at the first point in the first step it trains from step 2 on, the next one resumes and
dies at the second point in the first step *it* trains, and so on to the sixth; then a
plain `agentflow trainer` resumes and finishes. Each crash but the first's comes after a
resume from a checkpoint, and at least one step follows the last.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from tests.integration.trainer.crashing_trainer import DYING, POINTS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[3]
# The trainers die in steps 2, 2, 2, 2, 2 and 3: the first trains step 1 before its own,
# and only after before_ack and before_next_step is the step's checkpoint on disk (the next
# trainer resumes after it; otherwise it does the step again). The last trains step 4.
STEPS = 4
CRASH_FROM = 2  # the first crash has a checkpoint before it too
CHECKPOINTED = ("before_ack", "before_next_step")
ENV = "crash-parity"


@pytest.fixture(scope="module")
def gateway(
    sqlite_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A real gateway with the scripted parity env; its URL and database URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    directory = tmp_path_factory.mktemp("gateway")
    with gateway_process(sqlite_database, directory, port, OMP_NUM_THREADS="1"):
        env = {
            "name": ENV,
            "kind": "python",
            "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
        }
        made = httpx.post(f"{url}/v1/envs", json=env)
        assert made.status_code in (201, 409), made.text
        yield url, sqlite_database


def _config(tmp_path: Path, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "seed": 5,
        "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}},
        "engine": {"type": "local", "max_batch_size": 16},
        "envs": [{"id": ENV, "max_concurrency": 8}],
        "agent": {"max_turns": 1, "max_new_tokens": 4},
        "rollout": {"group_size": 2, "max_staleness": 1},
        "trainer": {
            "batch_episodes": 4,
            "steps": STEPS,
            "checkpoint_every": 1,
            "keep_checkpoints": 1,
            "threads": 1,
            "run_dir": str(tmp_path / "runs"),
        },
        "weights": {"sync": "disk", "dir": str(tmp_path / "weights")},
    }


def _trainer(
    command: list[str], log: Path, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run `command` to its end (killed past `timeout`); its output goes to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("a") as out:
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=out)
        try:
            code = process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return subprocess.CompletedProcess(command, code, log.read_text(), "")


def _consumed(database_url: str, run_id: str) -> list[str]:
    """The ids of the run's trajectories the gateway counts as trained (acknowledged)."""
    with sqlite3.connect(database_url.split("///", 1)[1]) as db:
        rows = db.execute(
            "SELECT id, status FROM trajectories WHERE run_id = ?", (run_id.replace("-", ""),)
        ).fetchall()
    assert not [i for i, status in rows if status == "leased"]  # none held by a dead trainer
    return [str(uuid.UUID(i)) for i, status in rows if status == "consumed"]


def test_a_killed_trainer_resumes_with_one_metrics_row_per_step(
    gateway: tuple[str, str], tmp_path: Path
) -> None:
    url, database = gateway
    config = _config(tmp_path, f"crash-{time.monotonic_ns()}")
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    args = ["trainer", str(config_file), "--gateway", url, "--run", run_id]
    crashing = [sys.executable, "-m", "tests.integration.trainer.crashing_trainer"]
    resumes_after = 0  # the checkpointed step the next trainer resumes from
    try:
        for point in POINTS:
            step = max(resumes_after + 1, CRASH_FROM)  # the first step it trains from 2 on
            log = tmp_path / f"trainer-{point}.log"
            died = _trainer([*crashing, point, str(CRASH_FROM), *args], log)
            # It reached `point` in that step: a point the loop no longer passes leaves it
            # alive, and it names the step it died in.
            assert died.returncode == -signal.SIGKILL, died.stdout[-3000:]
            dying = [line for line in died.stdout.splitlines() if line.startswith(DYING)]
            assert dying == [f"{DYING} {point} of step {step}"], died.stdout[-3000:]
            resumes_after = step if point in CHECKPOINTED else step - 1
        assert resumes_after < STEPS  # a step follows the last crash
        log = tmp_path / "trainer.log"
        resumed = _trainer([sys.executable, "-m", "trainer.cli", *args], log)
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        metrics = httpx.get(f"{url}/v1/runs/{run_id}/metrics").json()
    finally:
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)

    lines = (tmp_path / "runs" / config["name"] / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # each once, in order
    # The gateway's rows: one per step, at the version the file names, with its counts.
    api = {v["step"]: v for v in metrics["versions"] if v["step"] is not None}
    assert sorted(api) == list(range(1, STEPS + 1))
    # The others hold no step's metrics: the republish at the resume, and the versions
    # whose rows the redone steps replaced (a switch's own timing may stay).
    assert not [v for v in metrics["versions"] if v["step"] is None and "loss" in v["metrics"]]
    for row in rows:
        stored = api[row["step"]]
        assert stored["version"] == row["version"]
        assert stored["metrics"]["trajectories"] == row["trajectories"]
        assert stored["metrics"]["loss"] == pytest.approx(row["loss"])
        assert len(row["trajectory_ids"]) == row["trajectories"] > 0
    # Every trajectory the gateway counts as trained is in exactly one row, and no row
    # holds one the gateway does not count.
    trained = [i for row in rows for i in row["trajectory_ids"]]
    assert len(trained) == len(set(trained))
    assert sorted(trained) == sorted(_consumed(database, run_id))
