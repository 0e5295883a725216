"""A run played by two controller shards, end to end: `agentflow serve` on PostgreSQL, the
run created through the REST API with `rollout.controllers = 2`, the split trainer
(`agentflow trainer`, disk sync) training it, and one shard process killed (`SIGKILL`)
mid-run. A new shard takes its place, the trainer finishes its steps, every episode
ends with a final status (a killed shard's live ones aborted, naming it), every trained
batch is acknowledged once, and stopping the run ends every shard process. The same run
on SQLite is refused naming the field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PG_ADMIN_URL
from tests.e2e.test_split_trainer import _config
from tests.e2e.test_split_trainer_gateway_restart import _tail
from tests.integration.test_gateway_crash import _wait, gateway_process
from tests.integration.test_serve import _free_port
from tests.support.scratch_db import scratch_database

pytestmark = pytest.mark.integration

STEPS = 3
WORKER = "agentflow.rollout.shards.worker"


@pytest.fixture
def fresh_pg() -> Iterator[str]:
    """A database of its own: a gateway restarts every live run it finds on start."""
    with scratch_database(PG_ADMIN_URL, prefix="agentflow_shards") as url:
        yield url


def shard_pids(gateway_pid: int) -> list[int]:
    """The gateway's shard processes, by their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rpartition(") ")[2].split()[1])
        if parent == gateway_pid and WORKER in command:
            found.append(int(entry.name))
    return sorted(found)


def test_a_two_shard_run_trains_through_a_killed_shard(fresh_pg: str, tmp_path: Path) -> None:
    env: dict[str, Any] = {
        "name": f"parity-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
    }
    config = _config(tmp_path, env["name"])
    config["name"] = "sharded-e2e"
    config["rollout"] |= {"controllers": 2}
    config["trainer"] |= {"steps": STEPS}
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    gateway_log, trainer_log = tmp_path / "gateway.log", tmp_path / "trainer.log"

    with gateway_process(fresh_pg, tmp_path, port, log=gateway_log, OMP_NUM_THREADS="1") as gateway:
        assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
        created = httpx.post(f"{url}/v1/runs", json=config, timeout=120)
        assert created.status_code == 201, created.text + _tail(gateway_log)
        run_id = created.json()["id"]
        first = shard_pids(gateway.pid)
        assert len(first) == 2, _tail(gateway_log)
        with trainer_log.open("wb") as out:
            trainer = subprocess.Popen(
                [
                    sys.executable, "-m", "trainer.cli", "trainer", str(config_file),
                    "--gateway", url, "--run", run_id,
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _wait(lambda: httpx.get(f"{url}/v1/runs/{run_id}").json()["weight_version"] >= 1)
            os.kill(first[0], signal.SIGKILL)
            # A new shard takes its place; the other plays on.
            _wait(lambda: len(set(shard_pids(gateway.pid)) - set(first)) == 1, timeout=120)
            assert first[1] in shard_pids(gateway.pid)
            code = trainer.wait(timeout=300)
        except BaseException:
            trainer.kill()
            trainer.wait()
            raise
        assert code == 0, _tail(trainer_log) + _tail(gateway_log)
        run = httpx.get(f"{url}/v1/runs/{run_id}").json()
        assert run["weight_version"] == STEPS and run["status"] == "running"
        stopped = httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=120)
        assert stopped.status_code == 200, stopped.text
        assert shard_pids(gateway.pid) == [], _tail(gateway_log)  # every shard exited
        episodes = httpx.get(f"{url}/v1/runs/{run_id}/episodes", params={"limit": 1000}).json()[
            "items"
        ]

    assert "died (exit -9)" in gateway_log.read_text()
    assert episodes and all(e["status"] not in ("pending", "running") for e in episodes)
    aborted = [e for e in episodes if e["status"] == "aborted"]
    assert all(
        "controller shard" in (e["error"] or "") or "stopped" in (e["error"] or "") for e in aborted
    ), aborted
    assert not [e for e in episodes if e["status"] == "failed"]
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "sharded-e2e" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))


def test_a_sharded_run_on_sqlite_is_refused_naming_the_field(
    sqlite_database: str, tmp_path: Path
) -> None:
    config = _config(tmp_path, "agentflow/guess-number-v0")
    config["rollout"] |= {"controllers": 2}
    port = _free_port()
    with gateway_process(sqlite_database, tmp_path, port):
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/runs", json=config, timeout=60)
    assert refused.status_code == 422, refused.text
    assert "SQLite" in refused.text and "controllers" in refused.text
