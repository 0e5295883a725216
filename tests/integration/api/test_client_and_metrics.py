"""The typed client on the routes a trainer and an operator use (trajectory stream, run
metrics, models, Prometheus), and `/metrics` that a dead engine cannot hold up."""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest
from fastapi import FastAPI

from agentflow.agents.runtime import PolicyRuntime
from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.models import WeightVersion
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.rollout.stream_fixtures import finished_group, make_run

pytestmark = pytest.mark.integration


@pytest.fixture
async def app(settings: Settings) -> FastAPI:
    return create_app(settings)


async def test_the_typed_client_leases_acks_and_reports_metrics(settings: Settings) -> None:
    # With an API key: the models route, like the agents' routes, always wants a key.
    app = create_app(settings.model_copy(update={"api_key": "operator-key"}))
    async with app.router.lifespan_context(app):
        turns = app.state.turn_tree
        run = await make_run(turns)
        await finished_group(turns, run, 1, reward=0.5)
        async with turns.sessions.begin() as session:
            session.add(WeightVersion(run_id=run, version=1, uri="x", metrics={}))
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient(
            "http://gateway", api_key="operator-key", transport=transport
        ) as client:
            (trajectory,) = await client.lease(run, 4)
            assert trajectory.reward == 0.5 and trajectory.token_ids == (1, 2, 3, 4, 5)
            assert await client.ack(run, [trajectory.id], trajectory.lease_id) == 1
            assert await client.reclaim(run) == 0

            await client.record_metrics(run, 1, {"reward": 0.75, "loss": 0.125})
            versions = (await client.run_metrics(run))["versions"]
            assert versions[0]["metrics"] == {"reward": 0.75, "loss": 0.125}
            scrape = await client.prometheus_metrics()
            assert f'agentflow_trainer_metric{{name="reward",run="{run}"}} 0.75' in scrape
            assert f'agentflow_trainer_weight_version{{run="{run}"}} 1.0' in scrape
            assert await client.list_models() == []


async def test_a_step_recorded_again_keeps_one_row(settings: Settings) -> None:
    """A trainer killed after recording steps 2 and 3 but before checkpointing them resumes
    at step 1 and records them again at newer versions: one row per step remains."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        run = await make_run(app.state.turn_tree)
        async with app.state.turn_tree.sessions.begin() as session:
            for version in range(1, 7):
                session.add(WeightVersion(run_id=run, version=version, uri="x", metrics={}))
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:

            async def rows() -> dict[int, tuple[int | None, dict[str, float]]]:
                versions = (await client.run_metrics(run))["versions"]
                return {v["version"]: (v["step"], v["metrics"]) for v in versions}

            for step in (1, 2, 3):  # the first trainer: version = step
                await client.record_metrics(run, step, {"loss": float(step)}, step=step)
            # Its successor republished the checkpoint's weights as 4, then does step 2
            # again at 5, twice (a resent call): the old rows of steps 2 and 3 go.
            for _ in range(2):
                await client.record_metrics(run, 5, {"loss": 20.0}, step=2)
            assert await rows() == {
                1: (1, {"loss": 1.0}),
                2: (None, {}),
                3: (None, {}),
                4: (None, {}),
                5: (2, {"loss": 20.0}),
                6: (None, {}),
            }
            await client.record_metrics(run, 6, {"loss": 30.0}, step=3)
            # A late copy of an earlier call clears nothing recorded after it.
            await client.record_metrics(run, 1, {"loss": 1.0}, step=1)
            steps = {v: s for v, (s, _) in (await rows()).items() if s is not None}
            assert steps == {1: 1, 5: 2, 6: 3}
            # Without a step (an older trainer): stored as before, nothing cleared.
            await client.record_metrics(run, 4, {"loss": 4.0})
            assert (await rows())[4] == (None, {"loss": 4.0})
            assert len([s for s, _ in (await rows()).values() if s is not None]) == 3


async def test_a_scrape_does_not_wait_for_a_dead_engine(app: FastAPI) -> None:
    # A server that takes connections and never answers: the engine is hung, not gone.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        async with app.router.lifespan_context(app):
            engine = SGLangEngine(SGLangSettings(url=url, control_timeout_s=60))
            run = uuid.uuid4()
            app.state.runtimes.register(run, PolicyRuntime(engine, ByteChatTemplate()))
            transport = httpx.ASGITransport(app=app)
            try:
                async with AsyncClient("http://gateway", transport=transport) as client:
                    scrape = await client.prometheus_metrics()
            finally:
                app.state.runtimes.remove(run)
                await engine.close()
    assert f'agentflow_engine_up{{run="{run}"}} 0.0' in scrape
    assert "agentflow_episodes" in scrape  # the rest of the scrape is there
