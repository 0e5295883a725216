"""`trainer.ranks = 2`: `agentflow trainer` starts two torchrun ranks (gloo on CPU) that
train a gateway's run with FSDP2. Only rank 0 leases: every trajectory the gateway handed
out is trained once, on one rank, and acknowledged once; each step's batch is split
between the ranks, whose metrics add up to the batch's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_split_trainer import _config, run_trainer, trajectory_statuses
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration

STEPS = 2


def test_two_ranks_train_each_trajectory_once(sqlite_database: str, tmp_path: Path) -> None:
    env = {
        "name": f"parity-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
    }
    config = _config(tmp_path, env["name"])
    config["name"] = "split-ranks"
    config["trainer"] |= {"steps": STEPS, "checkpoint_every": 1, "ranks": 2}
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port, OMP_NUM_THREADS="1"):
        assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
        created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        trainer = run_trainer(config_file, url, run_id)
        assert httpx.get(f"{url}/v1/runs/{run_id}").json()["weight_version"] == STEPS
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)

    # One summary: rank 0's (the other rank prints none).
    assert trainer.stdout.count('"run_id"') == 1
    run_dir = tmp_path / "runs" / "split-ranks"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["ranks"] == 2
        assert row["trajectories"] >= config["trainer"]["batch_episodes"]
    # Every trajectory leased was trained once and acknowledged once: had each rank leased
    # its own batches, twice as many would be consumed as the steps' batches hold.
    statuses = trajectory_statuses(sqlite_database, run_id)
    assert "leased" not in statuses
    assert statuses.get("consumed", 0) == sum(int(r["trajectories"]) for r in rows)
    # Rank 0 wrote a plain checkpoint a single process loads.
    assert (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model" / "config.json").is_file()
