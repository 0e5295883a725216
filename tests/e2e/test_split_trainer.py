"""The split form end to end: `agentflow serve` executes a run, `agentflow trainer
--gateway` in another process leases its trajectories over HTTP, trains, and publishes
each version by disk sync; the gateway's engine then samples from those weights."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.modeling import ModelInit, build_model, load_model, score
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from tests.integration.trainer.test_weight_sync import _policy_turns

pytestmark = pytest.mark.integration

STEPS = 3


def _config(tmp_path: Path, env_id: str) -> dict[str, Any]:
    return {
        "name": "split-test",
        "seed": 5,
        "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 512}},
        "engine": {"type": "local", "max_batch_size": 32},
        "envs": [{"id": env_id, "max_concurrency": 32}],
        "agent": {"max_turns": 1, "max_new_tokens": 6},
        "rollout": {"group_size": 4, "max_staleness": 1},
        "trainer": {
            "batch_episodes": 8,
            "steps": STEPS,
            "checkpoint_every": 2,
            "run_dir": str(tmp_path / "runs"),
        },
        "weights": {"sync": "disk", "dir": str(tmp_path / "weights")},
    }


def _episode_on(url: str, run_id: str, version: int) -> dict[str, Any]:
    """A finished episode whose policy tokens all come from `version` (waits for one)."""
    listed = f"{url}/v1/runs/{run_id}/episodes"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        total = httpx.get(listed, params={"limit": 1}).json()["total"]
        page = {"limit": 20, "offset": max(0, total - 20)}
        for episode in reversed(httpx.get(listed, params=page).json()["items"]):
            if episode["status"] not in ("completed", "truncated"):
                continue
            tree = httpx.get(f"{url}/v1/episodes/{episode['id']}").json()
            turns = _policy_turns(tree)
            if turns and {v for _, t in turns for v in t["weight_versions"]} == {version}:
                return tree
        time.sleep(0.2)
    raise AssertionError(f"no finished episode played on version {version}")


def test_a_trainer_process_trains_a_gateway_run(sqlite_database: str, tmp_path: Path) -> None:
    # Rewards that differ within a group, so every step has a gradient to apply.
    env = {
        "name": f"parity-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
    }
    config = _config(tmp_path, env["name"])
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port):
        assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
        created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        run_trainer(config_file, url, run_id)
        run = httpx.get(f"{url}/v1/runs/{run_id}").json()
        assert run["weight_version"] == STEPS  # one published version per step
        played = _episode_on(url, run_id, STEPS)
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)

    run_dir = tmp_path / "runs" / "split-test"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()
    # Every trained batch was acknowledged exactly once (the last one at the final
    # checkpoint), and nothing is left leased to the finished trainer.
    statuses = trajectory_statuses(sqlite_database, run_id)
    assert "leased" not in statuses
    assert statuses.get("consumed", 0) == sum(int(r["trajectories"]) for r in rows)
    # The gateway's engine really serves the last version: what it recorded for an
    # episode played on it scores as the weights the trainer published.
    published = load_model(Path(config["weights"]["dir"]) / f"v{STEPS:06d}")
    initial = build_model(ModelInit.model_validate(config["model"]["init"]), seed=config["seed"])
    gaps = []
    for context, turn in _policy_turns(played):
        tokens = context + list(turn["token_ids"])
        expected = score(published, tokens, start=len(context))
        assert turn["logprobs"] == pytest.approx(expected, abs=1e-4)
        before = score(initial, tokens, start=len(context))
        gaps.append(max(abs(a - b) for a, b in zip(before, turn["logprobs"], strict=True)))
    assert max(gaps) > 1e-3  # the check tells the trained weights from the initial ones


def run_trainer(config_file: Path, url: str, run_id: str) -> subprocess.CompletedProcess[str]:
    """`agentflow trainer CONFIG --gateway URL --run ID`, run to its end; it must succeed."""
    trainer = subprocess.run(
        [
            sys.executable, "-m", "trainer.cli", "trainer", str(config_file),
            "--gateway", url, "--run", run_id,
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stdout[-3000:] + trainer.stderr[-3000:]
    return trainer


def trajectory_statuses(sqlite_url: str, run_id: str) -> dict[str, int]:
    """How many of the run's trajectories are in each status, read from the database."""
    with sqlite3.connect(sqlite_url.split("///", 1)[1]) as db:
        rows = db.execute(
            "SELECT status, COUNT(*) FROM trajectories WHERE run_id = ? GROUP BY status",
            (run_id.replace("-", ""),),
        )
        return {str(status): int(count) for status, count in rows}
