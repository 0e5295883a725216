"""The trajectory stream and run metrics over HTTP, against the real app and database."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from agentflow.api.app import create_app
from agentflow.client import RetryingTransport, RetryPolicy
from agentflow.config import Settings
from agentflow.db.models import Trajectory as TrajectoryRow
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
            body = {"max_n": 2, "min_n": 3}
            bad = await client.post(f"/v1/runs/{run}/trajectories/lease", json=body)
            assert bad.status_code == 422
            assert bad.json()["detail"][0]["loc"] == ["body", "min_n"]
            assert "at most max_n" in bad.json()["detail"][0]["msg"]

            # min_n travels: the pull waits for two, and the second comes meanwhile.
            puller = asyncio.create_task(stream.pull(4, timeout=30, min_n=2))
            await finished_group(turns, run, 1)
            await asyncio.sleep(0.2)
            assert not puller.done()
            await finished_group(turns, run, 1)
            pair = await asyncio.wait_for(puller, 10)
            assert len(pair) == 2 and len({t.lease_id for t in pair}) == 1
            assert await stream.ack([t.id for t in pair], pair[0].lease_id) == 2
            bad = await client.post(f"/v1/runs/{run}/trajectories/ack", json={"ids": ["nope"]})
            assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "ids"]
            missing = await client.post(
                f"/v1/runs/{uuid.uuid4()}/trajectories/lease", json={"max_n": 1}
            )
            assert missing.status_code == 404

            metrics = (await client.get(f"/v1/runs/{run}/metrics")).json()
            assert metrics["versions"][0]["metrics"] == {"reward": 0.5}


class _AnswerLostOnce(httpx.AsyncBaseTransport):
    """Carries the first lease to the app, then loses its answer (a gateway that died
    after committing), as `RetryingTransport` sees it."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.leases: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/lease"):
            self.leases.append(request.content)
            if len(self.leases) == 1:
                await response.aread()
                raise httpx.ReadError("the gateway hung up", request=request)
        return response


async def test_a_pull_whose_answer_was_lost_is_resent_and_leases_nothing_more(
    app: FastAPI,
) -> None:
    async with app.router.lifespan_context(app):
        turns = app.state.turn_tree
        run = await make_run(turns)
        for _ in range(2):
            await finished_group(turns, run, 1)
        losing = _AnswerLostOnce(httpx.ASGITransport(app=app))
        retrying = RetryingTransport(RetryPolicy(window_s=10, first_wait_s=0.01), losing)
        async with httpx.AsyncClient(transport=retrying, base_url="http://gateway") as client:
            (trajectory,) = await HttpTrajectoryStream(client, run).pull(1, timeout=0)
        assert len(losing.leases) == 2 and losing.leases[0] == losing.leases[1]
        async with turns.sessions() as session:
            rows = (
                await session.execute(
                    select(TrajectoryRow.id, TrajectoryRow.status).where(
                        TrajectoryRow.run_id == run
                    )
                )
            ).all()
        # The resent pull got the first pull's trajectory; the other one is still ready.
        assert sorted(status for _, status in rows) == ["leased", "ready"]
        assert dict(rows)[trajectory.id] == "leased"

        bad = await app_client_lease(app, run, {"max_n": 1, "lease_id": "NOT-HEX"})
        assert bad.status_code == 422
        assert bad.json()["detail"][0]["loc"] == ["body", "lease_id"]


async def app_client_lease(app: FastAPI, run: uuid.UUID, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return await client.post(f"/v1/runs/{run}/trajectories/lease", json=body)
