"""`agentflow train --ui-port`: the dashboard served by the training process itself, over
the run directory's database, with the run's engine live in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_train_serves_the_dashboard_while_it_trains(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "name": "dashboard-train",
                "seed": 1,
                "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}},
                "engine": {"type": "local", "max_batch_size": 16},
                "envs": [{"id": "agentflow/vault-v0", "max_concurrency": 16}],
                "agent": {"max_turns": 3, "max_new_tokens": 4},
                "rollout": {"group_size": 2},
                "trainer": {"batch_episodes": 8, "steps": 6, "run_dir": str(tmp_path / "runs")},
            }
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("AGENTFLOW_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "train", str(config), "--ui-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("dashboard: "):
            line = proc.stdout.readline()
            assert line, "the run ended without serving the dashboard"
        url = line.removeprefix("dashboard: ").strip()
        assert url.endswith("/ui")
        base = url.removesuffix("/ui")
        assert httpx.get(url, timeout=10).status_code == 200
        seen_engine = False
        deadline = time.monotonic() + 120
        while not seen_engine and time.monotonic() < deadline and proc.poll() is None:
            engines = httpx.get(f"{base}/ui/api/engines", timeout=10).json()["items"]
            seen_engine = any(e["up"] and e["engine"] == "LocalEngine" for e in engines)
            time.sleep(0.1)
        assert seen_engine  # the run's own engine, live in this process
        runs = httpx.get(f"{base}/ui/api/runs", timeout=10).json()["items"]
        assert [r["name"] for r in runs] == ["dashboard-train"]
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest[-3000:]
    with pytest.raises(httpx.ConnectError):  # gone with the process
        httpx.get(url, timeout=2)
