"""The split form with `nccl` sync and two trainer ranks: `agentflow serve` runs a
white-box run on an SGLang engine (the mock worker, its own process), and `agentflow
trainer` (`trainer.ranks = 2`: two torchrun ranks training with FSDP2, gloo on CPU)
broadcasts each version to it over a process group the worker joins through the gateway
(gloo on CPU: the calls NCCL takes between GPUs).

Checked, first, that a group the worker cannot join (NCCL without a GPU) fails the
publish with the worker's reason, through the gateway, without hanging the trainer. Then
a training run: the worker sees the group joined once, then per version the run's pause,
one `/update_weights_from_distributed` per bucket (every weight once, in order, the tied
output layer as the embedding, the cache flushed with the last), and continue; the
gateway records each version as a broadcast; every trained batch is acknowledged once;
and the worker serves the trained weights (an episode played on the last version scores
as the trainer's final checkpoint). Of the ranks: only rank 0 leases, so every trajectory
the gateway handed out is trained once, on one rank, and acknowledged once (had each rank
leased its own batches, twice as many would be consumed as the steps' batches hold);
each step's metrics are both ranks' combined; one summary is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.modeling import ModelInit, build_model, load_model, save_model, score
from tests.e2e.test_split_trainer import _episode_on, run_trainer, trajectory_statuses
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from tests.integration.trainer.test_weight_sync import _policy_turns, _wait_healthy
from trainer.broadcast_sync import BroadcastPublisher, BroadcastSettings
from trainer.weights import GatewayWeightTarget, WeightSyncError

pytestmark = pytest.mark.integration

STEPS = 2
INIT = {"layers": 1, "hidden": 32, "heads": 2, "max_context": 512}


def _config(tmp_path: Path, env_id: str, worker_url: str, model_dir: Path) -> dict[str, Any]:
    return {
        "name": "split-broadcast",
        "seed": 5,
        "model": {"path": str(model_dir)},
        "engine": {"type": "sglang", "urls": [worker_url], "behind_router": False},
        "envs": [{"id": env_id, "max_concurrency": 16}],
        "agent": {"max_turns": 1, "max_new_tokens": 6},
        "rollout": {"group_size": 4, "max_staleness": 1},
        "trainer": {
            "batch_episodes": 8,
            "steps": STEPS,
            "checkpoint_every": 1,
            "ranks": 2,
            "run_dir": str(tmp_path / "runs"),
        },
        "weights": {
            "sync": "nccl",
            "broadcast": {"backend": "gloo", "bucket_mb": 0.05, "timeout_s": 120},
        },
    }


async def _refused_group(url: str, run_id: str, model_dir: Path) -> None:
    target = GatewayWeightTarget(url, run_id)
    settings = BroadcastSettings(backend="nccl", device="cpu", timeout_s=3)
    publisher = BroadcastPublisher([target], settings)
    try:
        with pytest.raises(WeightSyncError, match="NCCL needs a GPU"):
            await publisher.publish(load_model(model_dir).state_dict(), 1)
        assert publisher.published_version == 0
    finally:
        publisher.close()
        await target.aclose()


def test_a_trainer_broadcasts_each_version_to_a_runs_sglang_engine(
    sqlite_database: str, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    initial = build_model(ModelInit.model_validate(INIT), seed=5)
    save_model(initial, model_dir)
    shapes = {n: tuple(t.shape) for n, t in initial.state_dict().items()}
    names = [n for n in shapes if n != "lm_head.weight"]  # tied: sent as the embedding
    worker_port = _free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "tests.support.mock_sglang",
            "--port", str(worker_port), "--model-path", str(model_dir),
        ],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {
        "name": f"parity-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
    }
    config = _config(tmp_path, env["name"], worker_url, model_dir)
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(worker_url, worker)
        with gateway_process(sqlite_database, tmp_path, port, OMP_NUM_THREADS="1"):
            assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
            created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            asyncio.run(_refused_group(url, run_id, model_dir))
            trainer = run_trainer(config_file, url, run_id)
            assert httpx.get(f"{url}/v1/runs/{run_id}").json()["weight_version"] == STEPS
            versions = httpx.get(f"{url}/v1/runs/{run_id}/metrics").json()["versions"]
            played = _episode_on(url, run_id, STEPS)
            httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)
        control = httpx.get(f"{worker_url}/mock/control").json()
    finally:
        worker.terminate()
        worker.wait(timeout=30)

    # The worker's view: the refused group, one group, then per version pause → buckets
    # → continue.
    assert control[0]["body"]["backend"] == "nccl"
    control = control[1:]
    routes = [c["route"] for c in control]
    assert routes.count("/init_weights_update_group") == 1
    group = control[routes.index("/init_weights_update_group")]["body"]
    assert (group["rank_offset"], group["world_size"], group["backend"]) == (1, 2, "gloo")
    after = routes[routes.index("/init_weights_update_group") + 1 :]
    updates = [c["body"] for c in control if c["route"] == "/update_weights_from_distributed"]
    assert sorted({u["weight_version"] for u in updates}) == [str(v) for v in range(1, STEPS + 1)]
    per_version = len(updates) // STEPS
    assert per_version > 1  # 50 KiB buckets: several per version
    expected = (["/pause_generation"] + ["/update_weights_from_distributed"] * per_version) + [
        "/continue_generation"
    ]
    assert after == expected * STEPS
    for k in range(STEPS):
        mine = updates[k * per_version : (k + 1) * per_version]
        assert {u["weight_version"] for u in mine} == {str(k + 1)}
        assert [u["flush_cache"] for u in mine] == [False] * (per_version - 1) + [True]
        assert all(u["group_name"] == group["group_name"] for u in mine)
        assert [n for u in mine for n in u["names"]] == names
        assert [tuple(s) for u in mine for s in u["shapes"]] == [shapes[n] for n in names]
        assert {d for u in mine for d in u["dtypes"]} == {"float32"}
    # The gateway recorded each version as a broadcast over that group.
    recorded = {v["version"]: v["uri"] for v in versions if v["version"] > 0}
    assert recorded == {v: f"broadcast://{group['group_name']}" for v in range(1, STEPS + 1)}

    run_dir = tmp_path / "runs" / "split-broadcast"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert trainer.stdout.count('"run_id"') == 1  # rank 0's summary; rank 1 prints none
    for row in rows:
        assert row["ranks"] == 2
        assert row["trajectories"] >= config["trainer"]["batch_episodes"]
    statuses = trajectory_statuses(sqlite_database, run_id)
    assert "leased" not in statuses
    assert statuses.get("consumed", 0) == sum(int(r["trajectories"]) for r in rows)
    # The worker serves the final weights: the trainer's last checkpoint scores what the
    # gateway recorded for an episode played on the last version.
    final = load_model(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model")
    for context, turn in _policy_turns(played):
        tokens = context + list(turn["token_ids"])
        assert turn["logprobs"] == pytest.approx(score(final, tokens, start=len(context)), abs=1e-4)
