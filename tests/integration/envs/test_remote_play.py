"""Full episodes over a real env server: our RemoteEnv over HTTP, OpenEnv's client over /ws."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import types
from typing import Any

import httpx
import openenv
import pytest

from envs import registry
from envs.base import EpisodeFinished, InvalidAction, StepTimeout, TextAction, UnknownEnv
from envs.client import RemoteEnv
from envs.server import create_app
from envs.sessions import EnvFactory
from tests.support.play import play_episode
from tests.unit.envs.fakes import CountingEnv, HangingEnv, RaisingEnv

pytestmark = pytest.mark.integration


def _openenv_client_class() -> Any:
    """OpenEnv's own `GenericEnvClient`, loaded without `openenv.core/__init__.py`.

    That `__init__` imports OpenEnv's server side (a Gradio UI, MCP), which takes 10-20 s
    on two cores; the client modules do not need it. The client code itself is unchanged.
    """
    if "openenv.core" not in sys.modules:
        package = types.ModuleType("openenv.core")
        package.__path__ = [f"{openenv.__path__[0]}/core"]
        sys.modules["openenv.core"] = package
    from openenv.core.generic_client import GenericEnvClient

    return GenericEnvClient


GenericEnvClient = _openenv_client_class()

BUILTINS = ("agentflow/guess-number-v0", "agentflow/calc-tool-v0", "agentflow/lookup-v0")


def builtin_app(**opts):
    factories: dict[str, EnvFactory] = {
        env_id: functools.partial(registry.make, env_id) for env_id in BUILTINS
    }
    return create_app(factories, **opts)


async def test_remote_env_plays_every_builtin_with_its_oracle(serve_app) -> None:
    url = serve_app(builtin_app())
    for env_id in BUILTINS:  # calc-tool runs its python tool in the real bwrap sandbox
        env = RemoteEnv(url, env=env_id, timeout_s=10)
        for seed in range(3):
            episode = await play_episode(env, registry.oracle(env_id), seed=seed)
            assert episode.success, (env_id, seed)
            assert episode.first.observation.messages[0].role == "user"
        if env_id != "agentflow/guess-number-v0":
            assert env.tools()[0]["type"] == "function"
        state = await env.state()
        assert state["done"] is True and state["env"] == env_id
        await env.close()
        await env.close()


async def test_remote_env_errors_map_to_exceptions(serve_app) -> None:
    app = create_app(
        {
            "test/counting-v0": CountingEnv,
            "test/hanging-v0": HangingEnv,
            "test/raising-v0": RaisingEnv,
        },
        step_timeout_s=5.0,
    )
    url = serve_app(app)
    absent = RemoteEnv(url, env="test/absent-v0")
    with pytest.raises(UnknownEnv):
        await absent.reset()
    await absent.close()

    env = RemoteEnv(url, env="test/counting-v0")
    await env.reset(seed=1)
    with pytest.raises(InvalidAction):
        await env.step(TextAction.model_construct(type="text", text=None))
    for _ in range(3):
        await env.step(TextAction(text="+"))
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="+"))
    await env.reset()
    assert not (await env.step(TextAction(text="+"))).done

    hanging = RemoteEnv(url, env="test/hanging-v0")
    await hanging.reset()
    with pytest.raises(StepTimeout):
        await hanging.step(TextAction(text="+"), timeout_s=0.2)
    assert hanging.session_id is None  # the server closed it; a reset opens a new one
    await hanging.reset()
    await hanging.close()

    raising = RemoteEnv(url, env="test/raising-v0")
    await raising.reset()
    await raising.step(TextAction(text="+"))
    with pytest.raises(Exception, match="simulated env bug"):
        await raising.step(TextAction(text="+"))
    await raising.close()

    # The server kept serving throughout, and only the healthy session is left.
    assert (await env.step(TextAction(text="+"))).observation.messages[0].content == "2"
    assert len(app.state.sessions.sessions) == 1
    await env.close()
    assert app.state.sessions.sessions == {}


async def test_openenv_client_plays_full_episodes_over_ws(serve_app) -> None:
    url = serve_app(builtin_app())
    oracle = registry.oracle("agentflow/guess-number-v0")
    from envs.base import Observation

    async with GenericEnvClient(base_url=url, message_timeout_s=10) as client:
        for seed in range(3):
            result = await client.reset(seed=seed)
            history = [Observation.model_validate(result.observation)]
            steps = 0
            while not result.done:
                action = oracle(history)
                result = await client.step(action.model_dump())
                history.append(Observation.model_validate(result.observation))
                steps += 1
            assert result.reward is not None and result.reward >= 0.6
            assert history[-1].messages[0].content == "correct" and steps <= 5
        state = await client.state()
        assert state["done"] is True
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await client.step({"type": "text"})
        with pytest.raises(RuntimeError, match="EXECUTION_ERROR"):
            await client.step({"type": "text", "text": "3"})  # the episode has ended


async def test_openenv_client_picks_env_and_sync_wrapper(serve_app) -> None:
    url = serve_app(builtin_app(max_sessions=1, default_env="agentflow/lookup-v0"))
    oracle = registry.oracle("agentflow/lookup-v0")
    from envs.base import Observation

    async with GenericEnvClient(base_url=url) as client:
        result = await client.reset(seed=4)
        history = [Observation.model_validate(result.observation)]
        while not result.done:
            result = await client.step(oracle(history).model_dump())
            history.append(Observation.model_validate(result.observation))
        assert result.reward == 1.0
        # With one session allowed, a second connection is refused with OpenEnv's code.
        async with GenericEnvClient(base_url=url) as second:
            with pytest.raises(RuntimeError, match="CAPACITY_REACHED"):
                await second.reset()

    def play_sync() -> float:
        with GenericEnvClient(base_url=url).sync() as env:
            result = env.reset(seed=1)
            guesses = [Observation.model_validate(result.observation)]
            policy = registry.oracle("agentflow/lookup-v0")
            while not result.done:
                result = env.step(policy(guesses).model_dump())
                guesses.append(Observation.model_validate(result.observation))
            return float(result.reward or 0)

    assert await asyncio.to_thread(play_sync) == 1.0


async def test_ws_session_closes_when_its_env_breaks(serve_app) -> None:
    for factory, steps_before_failure in ((RaisingEnv, 1), (HangingEnv, 0)):
        app = create_app({"test/broken-v0": factory}, step_timeout_s=0.3)
        url = serve_app(app)
        async with GenericEnvClient(base_url=url, message_timeout_s=10) as client:
            await client.reset(seed=1)
            for _ in range(steps_before_failure):
                await client.step({"type": "text", "text": "+"})
            with pytest.raises(RuntimeError, match="EXECUTION_ERROR"):
                await client.step({"type": "text", "text": "+"})
        assert app.state.sessions.sessions == {}
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/healthz")).json()["status"] == "ok"


async def test_ws_env_selector(serve_app) -> None:
    from websockets.asyncio.client import connect

    url = serve_app(builtin_app()).replace("http://", "ws://")
    async with connect(f"{url}/ws?env=agentflow/lookup-v0") as ws:
        await ws.send(json.dumps({"type": "reset", "data": {"seed": 2}}))
        reply = json.loads(await ws.recv())
        assert reply["type"] == "observation"
        assert "What pet" in reply["data"]["observation"]["messages"][0]["content"]
        await ws.send("not json")
        assert json.loads(await ws.recv())["data"]["code"] == "INVALID_JSON"
        await ws.send(json.dumps({"type": "dance"}))
        assert json.loads(await ws.recv())["data"]["code"] == "UNKNOWN_TYPE"
        await ws.send(json.dumps({"type": "close"}))
    async with connect(f"{url}/ws?env=test/absent-v0") as ws:
        await ws.send(json.dumps({"type": "reset"}))
        assert json.loads(await ws.recv())["data"]["code"] == "SESSION_ERROR"


async def test_idle_reaper_runs_in_the_server(serve_app) -> None:
    url = serve_app(create_app({"test/counting-v0": CountingEnv}, idle_ttl_s=0.2))
    env = RemoteEnv(url)
    await env.reset()
    await asyncio.sleep(0.8)
    with pytest.raises(UnknownEnv):
        await env.step(TextAction(text="+"))
    await env.close()


def test_cli_serves_a_registered_env(tmp_path) -> None:
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "envs.server", "agentflow/lookup-v0",
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        assert health.json()["status"] == "ok"
        envs = httpx.get(f"http://127.0.0.1:{port}/v1/envs", timeout=5).json()
        assert envs == {"default": "agentflow/lookup-v0", "envs": ["agentflow/lookup-v0"]}
    finally:
        server.terminate()
        # uvicorn shuts down cleanly on SIGTERM, then re-raises it: -15 is a clean exit.
        assert server.wait(timeout=30) in (0, -15), log.read_text()
