"""The remote provider against a local desktop's noVNC page: the env only connects,
and the state server in OSWorld's protocol (envs/desktop/state_server.py, served here
over the local desktop's shell, as a VM would serve it) lets the task set up and check."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from envs.desktop.env import make_env
from envs.desktop.local import LocalDesktopProvider
from envs.desktop.provider import Desktop
from envs.desktop.state_server import create_app
from envs.desktop.tasks import oracle
from tests.integration.desktop.conftest import under

pytestmark = pytest.mark.integration
KEY = "remote-test-key"


async def serve(app: FastAPI) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, task


@pytest.fixture
async def local_desktop(runtime_dir: Path) -> AsyncIterator[Desktop]:
    provider = LocalDesktopProvider(runtime_dir=runtime_dir)
    yield await provider.start((800, 600))
    await provider.aclose()


async def test_remote_task_through_a_state_server(
    local_desktop: Desktop, runtime_dir: Path
) -> None:
    assert local_desktop.shell is not None
    state_url, server, serving = await serve(create_app(local_desktop.shell, api_key=KEY))
    env = make_env(
        "terminal-echo", novnc_url=local_desktop.novnc_url, state_url=state_url, state_api_key=KEY
    )
    try:
        result = await env.reset(seed=3)
        assert result.info["screen"] == [800, 600]  # read from the remote's page
        assert result.info["display"] is None  # the env knows nothing local about it
        observations = [result.observation]
        while not result.terminated:
            result = await env.step(oracle(observations), timeout_s=30)
            observations.append(result.observation)
        assert result.reward == 1.0
        assert local_desktop.home is not None
        assert (local_desktop.home / "note.txt").read_text() == "orbit\n"
        await env.close()
        assert "Xvfb" in under(runtime_dir).values()  # closing the env leaves the VM running
        infeasible = make_env("infeasible-photoshop", novnc_url=local_desktop.novnc_url)
        try:  # the view alone: no state server, a task judged by the last action
            result = await infeasible.reset()
            assert result.info["screen"] == [800, 600]
            result = await infeasible.step(oracle([result.observation]))
            assert result.terminated and result.reward == 1.0
        finally:
            await infeasible.close()
    finally:
        await env.close()
        server.should_exit = True
        await serving
        from envs import registry

        await registry.close_shared()
