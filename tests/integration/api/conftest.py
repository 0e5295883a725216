from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, max_body_bytes=64 * 1024)


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[AsyncClient]:
    """The typed client talking to the real app (lifespan run) on the real database."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            yield client


@pytest.fixture
async def http(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A raw HTTP client on the same app, for status codes and error bodies."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client
