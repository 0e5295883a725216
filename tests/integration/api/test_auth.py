from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentflow.api.app import create_app
from agentflow.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
async def keyed(sqlite_database: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(database_url=sqlite_database, api_key="s3cret"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


async def test_routes_need_the_key(keyed: httpx.AsyncClient) -> None:
    for path in ("/v1/envs", "/v1/runs"):
        assert (await keyed.get(path)).status_code == 401
        wrong = await keyed.get(path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.headers["www-authenticate"] == "Bearer"
        ok = await keyed.get(path, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_health_and_docs_are_open(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/healthz")).json() == {"status": "ok", "database": "ok"}
    assert (await keyed.get("/docs")).status_code == 200
    assert (await keyed.get("/openapi.json")).status_code == 200
