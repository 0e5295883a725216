"""Runs started through the API play real episodes on the LocalEngine and end cleanly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.models import Episode, Run
from agentflow.db.session import create_engine
from envs import registry
from tests.integration.rollout.gateway import until
from tests.integration.rollout.scripted_envs import BrokenEnv, SlowEnv

pytestmark = pytest.mark.integration

TINY_MODEL = {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 512}}
LIVE = ("pending", "running")


@pytest.fixture(autouse=True)
def scripted_envs() -> Iterator[None]:
    registry.register("test/Slow-v0", SlowEnv, replace=True)
    registry.register("test/Broken-v0", BrokenEnv, replace=True)
    SlowEnv.live = SlowEnv.peak = 0
    yield
    registry.unregister("test/Slow-v0")
    registry.unregister("test/Broken-v0")


@pytest.fixture
def api(gateway: tuple[AsyncClient, httpx.AsyncClient]) -> AsyncClient:
    return gateway[0]


def _config(env_id: str, **rollout: Any) -> dict[str, Any]:
    return {
        "name": f"run-{uuid.uuid4().hex[:6]}",
        "model": TINY_MODEL,
        "envs": [{"id": env_id, "kwargs": {}}],
        "agent": {"max_turns": 4, "max_new_tokens": 8},
        "rollout": {"group_size": 2, **rollout},
    }


async def test_a_run_plays_its_episodes_and_finishes(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
) -> None:
    api, raw = gateway
    run = await api.create_run(_config("agentflow/guess-number-v0", max_episodes=4))
    assert run.status == "running"

    async def finished() -> bool:
        return (await api.get_run(run.id)).status == "finished"

    await until(finished)
    episodes = (await api.list_run_episodes(run.id)).items
    assert len(episodes) == 4
    assert {e.status for e in episodes} <= {"completed", "truncated"}
    assert len({e.group_id for e in episodes}) == 2  # two groups of two
    for group in {e.group_id for e in episodes}:
        assert len({e.task["seed"] for e in episodes if e.group_id == group}) == 1
    tree = await api.get_episode(episodes[0].id)
    assert tree["roots"][0]["kind"] == "prompt"
    assert tree["trajectories"], "a finished episode yields a trajectory"

    metrics = (await raw.get("/metrics")).text
    assert 'agentflow_turns_total{kind="policy"}' in metrics
    assert "agentflow_generate_seconds_count" in metrics
    assert "agentflow_env_step_seconds_count" in metrics
    finished = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('agentflow_episodes{status="completed"}')
        or line.startswith('agentflow_episodes{status="truncated"}')
    )
    assert finished >= 4  # the counter is process-wide: other tests count too


async def test_concurrency_cap_and_stop(api: AsyncClient) -> None:
    config = _config("test/Slow-v0", max_concurrency=3)
    config["envs"][0]["kwargs"] = {"delay": 0.3, "steps": 50}
    run = await api.create_run(config)

    async def three_live() -> bool:
        page = await api.list_run_episodes(run.id, status="running")
        return page.total == 3

    await until(three_live)
    paused = await api.pause_run(run.id)
    assert paused.status == "paused"
    resumed = await api.resume_run(run.id)
    assert resumed.status == "running"
    stopped = await api.stop_run(run.id)
    assert stopped.status == "stopped"
    assert SlowEnv.peak <= 3 and SlowEnv.live == 0  # the cap held; every env was closed
    episodes = (await api.list_run_episodes(run.id)).items
    assert episodes and not [e for e in episodes if e.status in LIVE]
    aborted = [e for e in episodes if e.status == "aborted"]
    assert aborted and all(e.error == "stopped through the API" for e in aborted)


async def test_a_broken_env_fails_episodes_then_the_run(api: AsyncClient) -> None:
    config = _config("test/Broken-v0", max_consecutive_failures=4)
    run = await api.create_run(config)

    async def failed() -> bool:
        return (await api.get_run(run.id)).status == "failed"

    await until(failed)
    current = await api.get_run(run.id)
    assert current.error is not None and "the env crashed" in current.error
    episodes = (await api.list_run_episodes(run.id)).items
    assert len([e for e in episodes if e.status == "failed"]) >= 4
    assert all(
        "RuntimeError: the env crashed" in (e.error or "") for e in episodes if e.status == "failed"
    )
    assert not [e for e in episodes if e.status in LIVE]


async def test_recovery_aborts_dangling_episodes_and_restarts_live_runs(
    settings: Settings, database_url: str
) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            run = await client.create_run(_config("test/Slow-v0", max_episodes=2), start=False)
            # A crash leaves an episode running and the run marked running.
            turns_engine = create_engine(database_url)
            async with turns_engine.begin() as conn:
                await conn.execute(update(Run).where(Run.id == run.id).values(status="running"))
                await conn.execute(
                    Episode.__table__.insert().values(
                        id=uuid.uuid4(),
                        run_id=run.id,
                        env_ref="test/Slow-v0",
                        task={},
                        status="running",
                        created_at=run.created_at,
                    )
                )
            await turns_engine.dispose()

    app = create_app(settings)  # the restart
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            episodes = (await client.list_run_episodes(run.id)).items
            dangling = [e for e in episodes if e.status == "aborted"]
            assert len(dangling) == 1 and "restarted" in (dangling[0].error or "")

            async def finished() -> bool:
                return (await client.get_run(run.id)).status == "finished"

            await until(finished)  # the run picked up where it was and played its episodes
            done = (await client.list_run_episodes(run.id, status="completed")).items
            assert len(done) == 2


async def test_a_run_that_cannot_start_is_refused_and_recorded(gateway: Any) -> None:
    api, raw = gateway
    config = _config("agentflow/guess-number-v0")
    config["model"] = {"path": "/nonexistent/checkpoint"}
    response = await raw.post("/v1/runs", json=config)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "model", "path"]
    (run,) = (await api.list_runs(name=config["name"])).items
    assert run.status == "failed" and "config.json missing" in (run.error or "")


def _weights(directory: Any, version: int) -> str:
    """An HF-format directory of the tiny model's weights, as a trainer publishes one."""
    from agentflow.modeling import ModelInit, build_model, save_model

    path = directory / f"v{version:06d}"
    save_model(build_model(ModelInit(**TINY_MODEL["init"]), seed=version), path)
    return str(path)


async def _published_run(settings: Settings, tmp_path: Any) -> tuple[uuid.UUID, str]:
    """A live run whose engine has switched to versions 1 and 2; the gateway then stops
    with the run still marked running, as a crash leaves it."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            run = await client.create_run(_config("test/Slow-v0"))
            for version in (1, 2):
                path = _weights(tmp_path, version)
                assert await client.update_weights(run.id, version, path) == version
    return run.id, path


async def test_a_restarted_run_serves_its_newest_published_weights(
    settings: Settings, tmp_path: Any
) -> None:
    run_id, _ = await _published_run(settings, tmp_path)
    app = create_app(settings)  # the restart
    async with app.router.lifespan_context(app):
        executor = await app.state.run_manager.live(run_id)
        info = await app.state.runtimes.get(run_id).engine.info()
        assert info.weight_version == executor.weight_version == 2
        await executor.stop("test over")


async def test_a_run_whose_newest_weights_are_gone_fails_with_that_reason(
    settings: Settings, tmp_path: Any
) -> None:
    import shutil

    run_id, newest = await _published_run(settings, tmp_path)
    shutil.rmtree(newest)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:

            async def failed() -> bool:
                return (await client.get_run(run_id)).status == "failed"

            await until(failed)
            error = (await client.get_run(run_id)).error or ""
            assert "version 2" in error and "no longer at" in error, error
            assert run_id not in app.state.runtimes


async def test_an_episode_end_that_fails_to_write_is_written_again(
    gateway: tuple[AsyncClient, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A briefly failing database (here: the first two writes of an episode's end raise,
    as a connection pool that timed out does) costs retries, not a dangling episode."""
    from agentflow.db.turn_tree import TurnTree
    from agentflow.rollout import executor

    monkeypatch.setattr(executor, "_COMPLETE_RETRY_S", 0.01)
    real = TurnTree.complete_episode
    failures = [OSError("pool timeout"), OSError("pool timeout")]

    async def flaky(self: TurnTree, *args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(TurnTree, "complete_episode", flaky)
    api, _ = gateway
    run = await api.create_run(_config("agentflow/guess-number-v0", max_episodes=4))

    async def finished() -> bool:
        return (await api.get_run(run.id)).status == "finished"

    await until(finished)
    assert not failures
    episodes = (await api.list_run_episodes(run.id)).items
    assert len(episodes) == 4
    assert {e.status for e in episodes} <= {"completed", "truncated"}
