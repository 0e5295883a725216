"""The trajectory stream and run metrics over HTTP, against the real app and database."""

from __future__ import annotations

import uuid

import httpx
import pytest
from fastapi import FastAPI

from agentflow.api.app import create_app
from agentflow.config import Settings
from agentflow.db.models import WeightVersion
from agentflow.rollout.stream import HttpTrajectoryStream
from tests.integration.rollout.stream_fixtures import finished_group, make_run

pytestmark = pytest.mark.integration


@pytest.fixture
async def app(settings: Settings) -> FastAPI:
    return create_app(settings)


async def test_lease_ack_and_metrics_over_http(app: FastAPI) -> None:
    async with app.router.lifespan_context(app):
        turns = app.state.turn_tree
        run = await make_run(turns)
        await finished_group(turns, run, 1, reward=0.5)
        async with turns.sessions.begin() as session:
            session.add(WeightVersion(run_id=run, version=1, uri="x", metrics={"reward": 0.5}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            stream = HttpTrajectoryStream(client, run)
            (trajectory,) = await stream.pull(4, timeout=0)
            assert trajectory.reward == 0.5 and trajectory.lease_id
            assert trajectory.token_ids == (1, 2, 3, 4, 5) and trajectory.loss_mask[-1] == 1
            assert await stream.ack([trajectory.id], trajectory.lease_id) == 1
            assert await stream.ack([trajectory.id], trajectory.lease_id) == 0
            assert await stream.reclaim() == 0

            bad = await client.post(f"/v1/runs/{run}/trajectories/lease", json={"max_n": 0})
            assert bad.status_code == 422
            assert bad.json()["detail"][0]["loc"] == ["body", "max_n"]
            bad = await client.post(f"/v1/runs/{run}/trajectories/ack", json={"ids": ["nope"]})
            assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "ids"]
            missing = await client.post(
                f"/v1/runs/{uuid.uuid4()}/trajectories/lease", json={"max_n": 1}
            )
            assert missing.status_code == 404

            metrics = (await client.get(f"/v1/runs/{run}/metrics")).json()
            assert metrics["versions"][0]["metrics"] == {"reward": 0.5}
