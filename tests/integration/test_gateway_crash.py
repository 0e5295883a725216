"""SIGKILL the gateway mid-run: no completed turn is lost and no episode stays live."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
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
    database_url: str, cwd: Path, port: int, *, log: Path | None = None, **extra_env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`agentflow serve` on `port`, healthy when entered, terminated when left; its output
    is appended to `log` when given."""
    env = {
        **os.environ,
        "AGENTFLOW_DATABASE_URL": database_url,
        "AGENTFLOW_ENV_MODULES": "tests.integration.rollout",  # the scripted envs' module
        "PYTHONPATH": str(Path(__file__).parents[2]),
        **extra_env,
    }
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("ab")) if log else subprocess.DEVNULL
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", "serve", "--port", str(port)],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
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


TINY_INIT = {"layers": 2, "hidden": 64, "heads": 2, "max_context": 512}


def _trajectory_versions(database_url: str, run_id: str) -> dict[str, int | None]:
    """Each stored trajectory of the run, and the oldest weight version in it."""
    import asyncio

    import asyncpg

    async def fetch() -> dict[str, int | None]:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg", "postgresql"))
        try:
            rows = await conn.fetch(
                "SELECT id, min_weight_version FROM trajectories WHERE run_id = $1",
                uuid.UUID(run_id),
            )
        finally:
            await conn.close()
        return {str(row[0]): row[1] for row in rows}

    return asyncio.run(fetch())


def test_sigkill_under_two_runs_restores_their_newest_weights(
    empty_pg_url: str, tmp_path: Path
) -> None:
    from agentflow.modeling import ModelInit, build_model, save_model

    migrate.upgrade(empty_pg_url)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    published = {}
    for version in (1, 2):
        path = tmp_path / "weights" / f"v{version:06d}"
        save_model(build_model(ModelInit(**TINY_INIT), seed=version), path)
        published[version] = str(path)
    with gateway_process(empty_pg_url, tmp_path, port) as proc:
        env = httpx.post(
            f"{url}/v1/envs",
            json={
                "name": "steady",
                "kind": "python",
                "spec": {
                    "entry_point": "tests.integration.rollout.scripted_envs:SlowEnv",
                    "kwargs": {"delay": 0.05, "steps": 2},
                },
            },
        )
        assert env.status_code == 201, env.text
        run_ids = []
        for name in ("first", "second"):
            run = httpx.post(
                f"{url}/v1/runs",
                json={
                    "name": name,
                    "model": {"init": TINY_INIT},
                    "envs": [{"id": "steady"}],
                    "agent": {"max_turns": 4, "max_new_tokens": 8},
                    "rollout": {"group_size": 2, "max_concurrency": 2},
                    # No trainer leases here: room for many groups ahead of it.
                    "trainer": {"batch_episodes": 256},
                },
                timeout=120,
            )
            assert run.status_code == 201, run.text
            run_ids.append(run.json()["id"])
        for run_id in run_ids:
            for version, path in published.items():
                switched = httpx.post(
                    f"{url}/v1/runs/{run_id}/weights",
                    json={"version": version, "path": path},
                    timeout=120,
                )
                assert switched.json() == {"version": version}, switched.text

        def made_with_newest() -> bool:
            return all(2 in _trajectory_versions(empty_pg_url, r).values() for r in run_ids)

        _wait(made_with_newest)
        before = {r: set(_trajectory_versions(empty_pg_url, r)) for r in run_ids}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    with gateway_process(empty_pg_url, tmp_path, port):

        def new_trajectories() -> dict[str, dict[str, int | None]]:
            return {
                r: {
                    t: v
                    for t, v in _trajectory_versions(empty_pg_url, r).items()
                    if t not in before[r]
                }
                for r in run_ids
            }

        _wait(lambda: all(len(made) >= 2 for made in new_trajectories().values()))
        for run_id, made in new_trajectories().items():
            assert set(made.values()) == {2}, f"run {run_id} sampled from {made}"
            assert before[run_id] <= set(_trajectory_versions(empty_pg_url, run_id))
            run = httpx.get(f"{url}/v1/runs/{run_id}").json()
            assert run["status"] == "running", run
            assert run["weight_version"] == 2
            httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=60)
