"""`agentflow desktop serve` as the stack runs it, minus Docker: a real subprocess on
fixed ports, played through the remote provider the way the gateway plays the stack's
`desktop` service, then SIGTERM and nothing of it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from envs.desktop.env import make_env
from envs.desktop.processes import free_port
from envs.desktop.tasks import oracle
from tests.integration.desktop.conftest import under, wait_until_gone

pytestmark = pytest.mark.integration


def _free_display() -> int:
    for number in range(180, 400):
        if (
            not Path(f"/tmp/.X{number}-lock").exists()
            and not Path(f"/tmp/.X11-unix/X{number}").exists()
        ):
            return number
    raise RuntimeError("no free X display number")


@pytest.fixture
def service(runtime_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    taken: set[int] = set()
    ports = {name: free_port(taken) for name in ("VNC", "NOVNC", "STATE")}
    key = f"dk-{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "AGENTFLOW_DESKTOP_API_KEY": key,
        "AGENTFLOW_DESKTOP_DISPLAY": str(_free_display()),
        "AGENTFLOW_DESKTOP_SCREEN": "800x600",
        "AGENTFLOW_DESKTOP_RUNTIME_DIR": str(runtime_dir),
        **{f"AGENTFLOW_DESKTOP_{name}_PORT": str(port) for name, port in ports.items()},
    }
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "desktop", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    state = f"http://127.0.0.1:{ports['STATE']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{state}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the desktop service did not get healthy"
            time.sleep(0.1)
        yield {
            "novnc_url": f"http://127.0.0.1:{ports['NOVNC']}/vnc.html?autoconnect=1&resize=off",
            "state_url": state,
            "key": key,
            "pid": str(proc.pid),
        }
    finally:
        if proc.poll() is None:
            proc.kill()  # the test failed before its SIGTERM: leave nothing behind
            proc.wait()
        log.close()


async def test_the_served_desktop_plays_a_task_and_stops_on_sigterm(
    service: dict[str, str], runtime_dir: Path
) -> None:
    assert {"Xvfb", "x11vnc", "websockify", "openbox"} <= set(under(runtime_dir).values())
    # The key is required: a client without it is refused before any command runs.
    refused = httpx.post(f"{service['state_url']}/execute", json={"command": "true"}, timeout=5)
    assert refused.status_code == 401
    # Registered the way docs/compose.md registers it: the page without host or port.
    env = make_env(
        "terminal-echo",
        novnc_url=service["novnc_url"],
        state_url=service["state_url"],
        state_api_key=service["key"],
    )
    try:
        result = await env.reset(seed=3)
        assert result.info["screen"] == [800, 600]
        observations = [result.observation]
        while not result.terminated:
            result = await env.step(oracle(observations), timeout_s=30)
            observations.append(result.observation)
        assert result.reward == 1.0
    finally:
        await env.close()
        from envs import registry

        await registry.close_shared()
    pid = int(service["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    assert done and os.waitstatus_to_exitcode(status) == 0
    await wait_until_gone(lambda: under(runtime_dir))
    assert not any(runtime_dir.iterdir())  # the desktop's folder (its home) is removed


def test_serve_refuses_to_start_without_a_key(runtime_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AGENTFLOW_DESKTOP_API_KEY"}
    argv = [
        sys.executable,
        "-m",
        "trainer.cli",
        "desktop",
        "serve",
        "--runtime-dir",
        str(runtime_dir),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "AGENTFLOW_DESKTOP_API_KEY" in done.stderr
    assert not runtime_dir.exists()  # refused before any desktop started
