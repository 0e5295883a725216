"""SIGKILL the gateway mid-run: no completed turn is lost and no episode stays live."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.db import migrate
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration

LIVE = ("pending", "running")


@contextmanager
def gateway_process(
    database_url: str, cwd: Path, port: int, **extra_env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`agentflow serve` on `port`, healthy when entered, terminated when left."""
    env = {
        **os.environ,
        "AGENTFLOW_DATABASE_URL": database_url,
        "AGENTFLOW_ENV_MODULES": "tests.integration.rollout",  # the scripted envs' module
        "PYTHONPATH": str(Path(__file__).parents[2]),
        **extra_env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentflow", "serve", "--port", str(port)],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def _wait(predicate: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _episodes(url: str, run_id: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/runs/{run_id}/episodes", params={"limit": 1000}).json()["items"]


def _turn_ids(url: str, episode_id: str) -> set[str]:
    tree = httpx.get(f"{url}/v1/episodes/{episode_id}").json()
    found, stack = set(), list(tree["roots"])
    while stack:
        node = stack.pop()
        found.add(node["id"])
        stack.extend(node["children"])
    return found


def test_sigkill_mid_run_loses_nothing(empty_pg_url: str, tmp_path: Path) -> None:
    migrate.upgrade(empty_pg_url)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(empty_pg_url, tmp_path, port) as proc:
        env = httpx.post(
            f"{url}/v1/envs",
            json={
                "name": "slow",
                "kind": "python",
                "spec": {
                    "entry_point": "tests.integration.rollout.scripted_envs:SlowEnv",
                    "kwargs": {
                        "delay": 1.0,
                        "steps": 3,
                    },  # long enough that the kill finds some live
                },
            },
        )
        assert env.status_code == 201, env.text
        run = httpx.post(
            f"{url}/v1/runs",
            json={
                "name": "crash",
                "model": {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 512}},
                "envs": [{"id": "slow"}],
                "agent": {"max_turns": 6, "max_new_tokens": 8},
                "rollout": {"group_size": 2, "max_concurrency": 4},
            },
            timeout=120,
        )
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]

        def some_done_some_live() -> bool:
            states = [e["status"] for e in _episodes(url, run_id)]
            return states.count("completed") >= 2 and any(s in LIVE for s in states)

        _wait(some_done_some_live)
        before = {e["id"]: _turn_ids(url, e["id"]) for e in _episodes(url, run_id)}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    with gateway_process(empty_pg_url, tmp_path, port):
        after = {e["id"]: e for e in _episodes(url, run_id)}
        for episode_id, turns in before.items():
            assert turns <= _turn_ids(url, episode_id), "a persisted turn was lost"
            assert after[episode_id]["status"] not in LIVE
        aborted = [after[e] for e in before if after[e]["status"] == "aborted"]
        assert aborted and all("restarted" in e["error"] for e in aborted)
        stopped = httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=60)
        assert stopped.json()["status"] == "stopped"
        assert not [e for e in _episodes(url, run_id) if e["status"] in LIVE]
