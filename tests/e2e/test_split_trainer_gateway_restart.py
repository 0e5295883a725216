"""The gateway restarts under a running split trainer: `kill -9` of `agentflow serve`, then
the same command on the same port and database. The trainer, never restarted, waits the
restart out (its log shows the retries), then finishes its steps on the restarted
gateway; every trained batch is acknowledged once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_split_trainer import _config, trajectory_statuses
from tests.integration.test_gateway_crash import _wait, gateway_process
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration

STEPS = 3


def _tail(path: Path, n: int = 3000) -> str:
    return f"--- {path.name} ---\n{path.read_text(errors='replace')[-n:]}\n"


def test_the_trainer_rides_out_a_gateway_restart(sqlite_database: str, tmp_path: Path) -> None:
    env: dict[str, Any] = {
        "name": f"parity-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
    }
    config = _config(tmp_path, env["name"])
    config["name"] = "split-restart"
    # Deadlines inside the window `--retry-window-s` gives (the defaults fit 300 s).
    gateway_calls = {"attempt_timeout_s": 30, "publish_timeout_s": 60}
    config["trainer"] |= {"steps": STEPS, "checkpoint_every": 2, "gateway": gateway_calls}
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    gateway_log, trainer_log = tmp_path / "gateway.log", tmp_path / "trainer.log"

    def serve() -> Any:
        return gateway_process(
            sqlite_database, tmp_path, port, log=gateway_log, OMP_NUM_THREADS="1"
        )

    with gateway_process(
        sqlite_database, tmp_path, port, log=gateway_log, OMP_NUM_THREADS="1"
    ) as gateway:
        assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
        created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        with trainer_log.open("wb") as out:
            trainer = subprocess.Popen(
                [
                    sys.executable, "-m", "trainer.cli", "trainer", str(config_file),
                    "--gateway", url, "--run", run_id, "--retry-window-s", "120",
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            # Mid-run: the trainer has published a version and trains on.
            _wait(lambda: httpx.get(f"{url}/v1/runs/{run_id}").json()["weight_version"] >= 1)
            gateway.kill()  # SIGKILL
            gateway.wait(timeout=10)
            time.sleep(1.0)  # the trainer finds nobody there for a while
            assert trainer.poll() is None, _tail(trainer_log)
        except BaseException:
            trainer.kill()
            trainer.wait()
            raise

    with serve():
        try:
            code = trainer.wait(timeout=240)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
            raise AssertionError(
                "the trainer did not finish\n" + _tail(trainer_log) + _tail(gateway_log)
            ) from None
        assert code == 0, _tail(trainer_log) + _tail(gateway_log)
        run = httpx.get(f"{url}/v1/runs/{run_id}").json()
        assert run["weight_version"] == STEPS  # one version per step, none twice
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)

    logged = trainer_log.read_text()
    retries = [line for line in logged.splitlines() if " failed (attempt " in line]
    assert retries, logged[-3000:]
    assert any("ConnectError" in line for line in retries), retries
    assert all(line.startswith(("POST ", "GET ")) and "retrying in" in line for line in retries)
    assert "Traceback" not in logged

    run_dir = tmp_path / "runs" / "split-restart"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    statuses = trajectory_statuses(sqlite_database, run_id)
    # Every trained batch was acknowledged once, across the restart. (A lease whose answer
    # the kill cut off would stay `leased` until `rollout.lease_s`: not an error.)
    assert statuses.get("consumed", 0) == sum(int(r["trajectories"]) for r in rows)
