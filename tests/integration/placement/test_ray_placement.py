"""A run placed on a real Ray cluster (started on loopback for this module): engine
actors behind the gateway, one killed mid-run, and env servers as actors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef, WeightUpdate
from agentflow.modeling import ModelInit, build_model, save_model
from agentflow.placement.engines import RayEngine, RayEnginePool, place_engines
from agentflow.run_config import RunConfig

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.integration

TINY = {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}
TERMINAL = {"completed", "truncated", "failed", "aborted"}
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    from agentflow.placement.cluster import connect, disconnect

    connect("local", num_cpus=8, object_store_mb=128)
    yield
    disconnect()  # the cluster's processes end with the module


def run_config(**placement: Any) -> dict[str, Any]:
    return {
        "name": f"placed-{uuid.uuid4().hex[:6]}",
        "model": {"init": TINY},
        "envs": [{"id": "agentflow/guess-number-v0", "max_concurrency": 8}],
        "agent": {"max_turns": 5, "max_new_tokens": 8, "max_tokens": 256},
        "rollout": {"group_size": 2, "max_concurrency": 8, "wait_for_trainer": False},
        "placement": {"ray": "local", "engines": 2, "engine_cpus": 0.5, **placement},
    }


@pytest.fixture
async def gateway(cluster: None, pg_database: str) -> AsyncIterator[tuple[AsyncClient, Any]]:
    app = create_app(Settings(database_url=pg_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            yield client, app


async def until(predicate: Any, timeout: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def all_episodes(api: AsyncClient, run_id: uuid.UUID) -> list[Any]:
    items, offset = [], 0
    while True:
        page = (await api.list_run_episodes(run_id, limit=100, offset=offset)).items
        items += page
        if len(page) < 100:
            return items
        offset += 100


async def ended(api: AsyncClient, run_id: uuid.UUID, n: int) -> bool:
    """Whether at least `n` of the run's episodes have ended."""
    return sum(e.status in TERMINAL for e in await all_episodes(api, run_id)) >= n


async def test_engine_actors_route_by_session_and_take_weights(cluster: None) -> None:
    config = RunConfig.model_validate(run_config())
    pool, max_context = await asyncio.to_thread(place_engines, config)
    try:
        assert isinstance(pool, RayEnginePool) and max_context == 256
        pids = {(await e.actor.ready.remote())["pid"] for e in pool.engines() if e is not None}
        assert len(pids) == 2  # two processes, neither this one
        sessions = [await pool.open_session() for _ in range(4)]
        info = await pool.info()
        assert [m["index"] for m in info.extra["members"]] == [0, 1]
        assert info.sessions == 4
        for sid in sessions:
            request = GenerateRequest(
                input_ids=(1, 2, 3),
                sampling=SamplingParams(max_new_tokens=4),
                session=SessionRef(session_id=sid),
            )
            assert len((await pool.generate(request)).output_ids) == 4
        state = build_model(ModelInit(**TINY), seed=1).state_dict()
        assert await pool.update_weights(WeightUpdate(state_dict=state)) == 1
        members = (await pool.info()).extra["members"]
        assert len(members) == 2
        for engine in pool.engines():
            assert isinstance(engine, RayEngine)
            assert (await engine.info()).weight_version == 1
    finally:
        await pool.close()


async def test_killing_an_engine_actor_mid_run_loses_no_episode(
    gateway: tuple[AsyncClient, Any],
) -> None:
    api, app = gateway
    run = await api.create_run(run_config())
    pool = app.state.runtimes.get(run.id).engine
    assert isinstance(pool, RayEnginePool)

    await until(lambda: ended(api, run.id, 6))
    victim = pool.engines()[0]
    assert isinstance(victim, RayEngine)

    async def generating() -> bool:
        # Killed while live episodes have sessions on it and one of them is generating,
        # so the kill takes a request with it: between groups an engine can hold no
        # session for a moment, and sessions whose episodes are in their last env step
        # end without another request (a kill then loses nothing).
        info = await victim.info()
        return info.sessions >= 2 and info.running >= 1

    await until(generating)
    ray.kill(victim.actor, no_restart=True)

    async def replacement_served() -> bool:
        if pool.counters.replaced < 1:
            return False
        members = (await pool.info()).extra["members"]
        return any(m["generation"] == 1 and m["steps"] > 0 for m in members)

    await until(replacement_served, timeout=300.0)  # a new actor loads torch and the model
    # A few more episodes past the replacement show the run goes on; the kill's effects
    # (lost requests resent, nothing failed) are settled by then.
    await until(lambda: ended(api, run.id, 16))
    await api.stop_run(run.id)
    await until(lambda: _status(api, run.id, "stopped"))

    assert pool.counters.lost == 1 and pool.counters.replaced == 1
    assert pool.counters.lost_requests >= 1, "the dead engine held sessions"
    episodes = await all_episodes(api, run.id)
    executor_started = len(episodes)
    assert executor_started >= 16
    assert {e.status for e in episodes} <= TERMINAL, "every episode ended, none dangles"
    by_status = {s: sum(e.status == s for e in episodes) for s in TERMINAL}
    # The turns that were on the dead engine were sent again on a live one: no episode
    # failed; the only aborted ones are those the stop cut short, with that reason.
    assert by_status["failed"] == 0, [e.error for e in episodes if e.status == "failed"]
    assert by_status["completed"] + by_status["truncated"] >= 16
    for episode in episodes:
        if episode.status == "aborted":
            assert episode.error == "stopped through the API"


async def test_env_servers_as_actors_serve_the_episodes_and_are_replaced(
    gateway: tuple[AsyncClient, Any],
) -> None:
    api, app = gateway
    run = await api.create_run(run_config(engines=1, env_servers=2, env_cpus=0.5))
    servers = app.state.run_manager._env_servers[run.id]
    urls = servers.urls["agentflow/guess-number-v0"]
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    seen = dict.fromkeys(urls, 0)

    async def both_served() -> bool:
        async with httpx.AsyncClient() as http:
            for url in urls:
                try:
                    health = (await http.get(f"{url}/healthz")).json()
                except httpx.TimeoutException:  # a loaded machine: ask again, until's bound
                    return False
                seen[url] = max(seen[url], health["sessions"])
        return all(seen.values())

    await until(both_served)

    async def finished(n: int) -> bool:
        episodes = await all_episodes(api, run.id)
        return sum(e.status in ("completed", "truncated") for e in episodes) >= n

    await until(lambda: finished(4))
    ray.kill(servers.servers[0].actor, no_restart=True)

    async def replaced() -> bool:
        return servers.replaced == 1 and len(servers.urls["agentflow/guess-number-v0"]) == 2

    await until(replaced)
    new_url = servers.servers[0].url
    assert new_url not in urls
    await until(lambda: finished(12))
    await api.stop_run(run.id)
    await until(lambda: _status(api, run.id, "stopped"))
    episodes = await all_episodes(api, run.id)
    assert {e.status for e in episodes} <= TERMINAL
    # Only episodes whose env state died with its server failed, each saying so.
    for episode in episodes:
        if episode.status == "failed":
            assert "env server" in (episode.error or ""), episode.error
    assert run.id not in app.state.run_manager._env_servers  # stopped with the run
    async with httpx.AsyncClient() as http:
        for url in (urls[1], new_url):
            with pytest.raises(httpx.TransportError):
                await http.get(f"{url}/healthz", timeout=2.0)


async def _status(api: AsyncClient, run_id: uuid.UUID, status: str) -> bool:
    return (await api.get_run(run_id)).status == status


def mock_sglang_command() -> list[str]:
    """The stand-in SGLang server (tests/support/mock_sglang.py) in SGLang's place."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); "
    code += "from tests.support.mock_sglang import main; main()"
    return [
        "{python}", "-c", code,
        "--host", "{host}", "--port", "{port}", "--model-path", "{model_path}",
    ]  # fmt: skip


async def test_sglang_servers_started_by_engine_actors_die_with_them(
    gateway: tuple[AsyncClient, Any], tmp_path: Path
) -> None:
    api, app = gateway
    model_dir = save_model(build_model(ModelInit(**TINY), seed=0), tmp_path / "model")
    config = run_config(sglang_command=mock_sglang_command(), sglang_ready_s=120)
    config.update(model={"path": str(model_dir)}, engine={"type": "sglang", "max_context": 256})
    run = await api.create_run(config)
    pool = app.state.runtimes.get(run.id).engine
    assert isinstance(pool, RayEnginePool)
    urls = [await e.actor.server_url.remote() for e in pool.engines() if isinstance(e, RayEngine)]
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)

    await until(lambda: ended(api, run.id, 4))
    victim = pool.engines()[0]
    assert isinstance(victim, RayEngine)
    url = await victim.actor.server_url.remote()
    ray.kill(victim.actor, no_restart=True)

    async def replaced() -> bool:
        return pool.counters.replaced >= 1

    await until(replaced)

    async def server_gone() -> bool:
        async with httpx.AsyncClient() as http:
            try:
                await http.get(f"{url}/health", timeout=1.0)
            except httpx.TransportError:
                return True
        return False

    await until(server_gone, timeout=30.0)  # the server went with its actor
    await until(lambda: ended(api, run.id, 12))
    await api.stop_run(run.id)
    await until(lambda: _status(api, run.id, "stopped"))
    episodes = await all_episodes(api, run.id)
    assert {e.status for e in episodes} <= TERMINAL
    assert not [e.error for e in episodes if e.status == "failed"]


async def test_vllm_servers_started_by_engine_actors_serve_and_die_with_them(
    cluster: None, tmp_path: Path
) -> None:
    """An engine actor that starts a vLLM server from `[engine.launch]`: the driver makes
    the untied copy the server loads, the actor's engine serves turns and takes a
    version, and a server killed with SIGKILL takes its actor with it (a lost engine
    for the pool to replace)."""
    from agentflow.errors import EngineLost
    from tests.integration.inference.vllm.conftest import vllm_python

    # vLLM's CPU attention takes heads of 32 dims and more (TINY's are 16).
    shape = ModelInit(**{**TINY, "hidden": 64})
    tied = save_model(build_model(shape, seed=0), tmp_path / "model")
    config = RunConfig.model_validate(
        {
            **run_config(engines=1),
            "model": {"path": str(tied)},
            "engine": {
                "type": "vllm",
                "launch": {"python": str(vllm_python()), "max_model_len": 256},
            },
            "weights": {"sync": "disk"},
            "trainer": {"run_dir": str(tmp_path / "runs")},
        }
    )
    pool, max_context = await asyncio.to_thread(place_engines, config)
    try:
        assert max_context == 256
        (engine,) = pool.engines()
        assert isinstance(engine, RayEngine)
        url = await engine.actor.server_url.remote()
        assert url.startswith("http://127.0.0.1:")
        served = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["root"]
        assert served == str(tmp_path / "runs" / config.name / "vllm" / "served-model")
        session = await pool.open_session()
        request = GenerateRequest(
            input_ids=(1, 2, 3),
            sampling=SamplingParams(max_new_tokens=4),
            session=SessionRef(session_id=session),
        )
        answer = await pool.generate(request)
        assert len(answer.output_ids) == len(answer.logprobs) == 4
        assert await pool.update_weights(WeightUpdate(path=served, version=1)) == 1
        assert (await engine.info()).weight_version == 1

        port = url.rsplit(":", 1)[1]
        # The API server only (its group leader's command line names it too).
        api_server = f"^\\S*python -m vllm.entrypoints.openai.api_server .*--port {port} "
        found = subprocess.run(["pgrep", "-f", api_server], capture_output=True, text=True)
        (pid,) = found.stdout.split()
        group = os.getpgid(int(pid))  # the server's processes: API server, engine core, worker
        os.kill(int(pid), signal.SIGKILL)

        async def actor_gone() -> bool:
            try:
                await engine.actor.ready.remote()
            except ray.exceptions.RayActorError:
                return True
            return False

        await until(actor_gone, timeout=60.0)
        with pytest.raises(EngineLost):
            await pool.generate(request)

        async def group_gone() -> bool:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return True
            return False

        await until(group_gone, timeout=30.0)  # nothing of the server outlives its actor
    finally:
        await pool.close()


async def test_an_env_server_actor_runs_the_envs_sandboxes(cluster: None) -> None:
    """A sandboxed tool env served by an actor: the tool's bubblewrap sandbox runs in
    the actor's process, on its node, within its CPUs."""
    from agentflow.placement.env_servers import place_env_servers
    from agentflow.rollout.envs import EnvSource
    from envs.base import TextAction

    config = RunConfig.model_validate(
        {
            **run_config(env_servers=1, env_cpus=0.5),
            "envs": [{"id": "agentflow/calc-tool-v0"}],
        }
    )
    source = EnvSource(
        ref="agentflow/calc-tool-v0", weight=1.0, max_concurrency=4, step_timeout_s=None
    )
    servers = await place_env_servers(config, [source])
    try:
        (placed,) = servers.sources([source])
        env = placed.make()
        await env.reset(seed=3)
        result = await env.step(TextAction(text="python(print(6 * 7))"))
        assert "42" in result.observation.messages[-1].content
        await env.close()
    finally:
        await servers.close()


async def test_engines_the_cluster_cannot_hold_are_refused_saying_so(
    cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentflow.errors import EngineUnavailable
    from agentflow.placement import engines

    monkeypatch.setattr(engines, "_GROUP_TIMEOUT_S", 2.0)
    config = RunConfig.model_validate(run_config(engine_gpus=1))  # a cluster with no GPU
    with pytest.raises(EngineUnavailable, match="cannot hold 2 engine actors"):
        await asyncio.to_thread(place_engines, config)
