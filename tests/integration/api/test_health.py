"""The probes: `/livez` never asks the database, `/readyz` (and `/healthz`) do."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from agentflow.api.app import create_app
from agentflow.api.public_url import INSTANCE_HEADER
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.session import create_engine, session_factory

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # free once closed: nothing listens there


@pytest.fixture
def unreachable_url() -> str:
    return f"postgresql+asyncpg://postgres@127.0.0.1:{_closed_port()}/test"


@pytest.fixture
async def database_down(unreachable_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway whose database does not answer. Its lifespan would refuse to start on
    such a database, so the state it sets up is built here without the schema check."""
    app = create_app(Settings(database_url=unreachable_url))
    engine = create_engine(unreachable_url)
    app.state.sessionmaker = session_factory(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client
    await engine.dispose()


async def test_probes_answer_ok_on_a_live_database(http: httpx.AsyncClient) -> None:
    live = await http.get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    assert live.headers[INSTANCE_HEADER]
    for path in ("/readyz", "/healthz"):
        ready = await http.get(path)
        assert ready.status_code == 200, path
        assert ready.json() == {"status": "ok", "database": "ok"}


async def test_livez_answers_while_the_database_is_down(database_down: httpx.AsyncClient) -> None:
    live = await database_down.get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    for path in ("/readyz", "/healthz"):
        ready = await database_down.get(path)
        assert ready.status_code == 503, path
        assert ready.json()["status"] == "error" and ready.json()["database"]


async def test_probes_need_no_api_key(sqlite_database: str) -> None:
    app = create_app(Settings(database_url=sqlite_database, api_key="s3cret"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            assert (await client.get("/v1/envs")).status_code == 401
            live = await client.get("/livez")
            assert live.headers[INSTANCE_HEADER] == app.state.instance_id
            assert (await client.get("/readyz")).status_code == 200


async def test_the_client_asks_livez_and_readyz(api: AsyncClient) -> None:
    assert await api.live() == {"status": "ok"}
    assert await api.health() == {"status": "ok", "database": "ok"}
