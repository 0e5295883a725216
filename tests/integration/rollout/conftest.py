"""A `TurnTree` on each real database (SQLite file and PostgreSQL), migrations applied;
and the gateway app on it (`gateway.serve_gateway`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.session import session_factory
from agentflow.db.turn_tree import TurnTree
from tests.integration.rollout.gateway import serve_gateway


@pytest.fixture
def turn_tree(db_engine: AsyncEngine) -> TurnTree:
    return TurnTree(session_factory(db_engine))


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url)


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[tuple[AsyncClient, httpx.AsyncClient]]:
    """The typed client and a raw one, on one app with its lifespan running."""
    async with serve_gateway(settings) as pair:
        yield pair
