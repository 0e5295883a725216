"""Distillation end to end in both process forms: `agentflow train` and the split
trainer (`agentflow trainer --gateway`) both score every step with the run's teachers
(two teachers, per-turn routing on the relay env) and record each teacher's figures; a
missing teacher checkpoint stops either before anything runs, naming the path."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.modeling import ModelInit, build_model, save_model
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration

STEPS = 3
INIT = {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}
RELAY = "agentflow/digit-relay-v0"


def _teachers(tmp_path: Path) -> list[dict[str, Any]]:
    out = []
    for seed, name in enumerate(("mirror", "shift")):
        path = save_model(
            build_model(ModelInit.model_validate(INIT), seed=seed + 7), tmp_path / name
        )
        out.append({"name": name, "path": str(path)})
    return out


def _config(tmp_path: Path, **trainer: Any) -> dict[str, Any]:
    return {
        "name": "distill-test",
        "seed": 2,
        "model": {"init": INIT},
        "engine": {"type": "local", "max_batch_size": 32},
        "envs": [{"id": RELAY, "max_concurrency": 32, "kwargs": {"length": 2}}],
        "agent": {"max_turns": 3, "max_new_tokens": 4},
        "rollout": {"group_size": 4, "max_staleness": 1},
        "trainer": {
            "batch_episodes": 8,
            "steps": STEPS,
            "checkpoint_every": 2,
            "run_dir": str(tmp_path / "runs"),
            **trainer,
        },
        "distill": {"route": "turn", "rule": "agentflow.turn_rules:command_word"},
        "teachers": _teachers(tmp_path),
    }


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_teacher_metrics(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        # Both teachers scored turns of every step: the relay alternates skills.
        for name in ("mirror", "shift"):
            assert row[f"teacher/{name}/tokens"] > 0
            assert math.isfinite(row[f"teacher/{name}/kl"])  # sampled: k1, either sign
        assert row["teachers_resident_peak"] == 1.0  # max_resident defaults to 1


def test_the_embedded_trainer_distils(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps(_config(tmp_path)))
    done = cli("train", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_teacher_metrics(tmp_path / "runs" / "distill-test")


def test_a_missing_teacher_checkpoint_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    document = _config(tmp_path)
    document["teachers"][1]["path"] = str(tmp_path / "gone")
    config = tmp_path / "run.json"
    config.write_text(json.dumps(document))
    done = cli("train", str(config))
    assert done.returncode != 0
    assert str(tmp_path / "gone") in done.stderr and "does not exist" in done.stderr
    assert not (tmp_path / "runs" / "distill-test").exists()  # nothing was started


def train_split(document: dict[str, Any], sqlite_database: str, tmp_path: Path) -> str:
    """A gateway executes the run of `document`; `agentflow trainer --gateway` trains all
    of its `trainer.steps` by disk sync; then the run is stopped. Returns the run's id."""
    document = {**document, "weights": {"sync": "disk", "dir": str(tmp_path / "weights")}}
    config = tmp_path / "run.json"
    config.write_text(json.dumps(document))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port):
        created = httpx.post(f"{url}/v1/runs", json=document, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        done = cli("trainer", str(config), "--gateway", url, "--run", run_id)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run = httpx.get(f"{url}/v1/runs/{run_id}").json()
        assert run["weight_version"] == document["trainer"]["steps"]
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)
    return str(run_id)


def test_the_split_trainer_distils(sqlite_database: str, tmp_path: Path) -> None:
    train_split(_config(tmp_path), sqlite_database, tmp_path)
    _check_teacher_metrics(tmp_path / "runs" / "distill-test")
