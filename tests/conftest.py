"""Shared fixtures: real databases with the migrations applied.

PostgreSQL tests run against the server at 127.0.0.1:5432 (trust auth). Each test
session makes its own database (from the `test` maintenance database) and drops it
afterwards, so parallel runs and other users of the server never collide.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db import migrate
from agentflow.db.session import create_engine
from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database

PG_ADMIN_URL = os.environ.get("AGENTFLOW_TEST_PG_URL", DEFAULT_ADMIN_URL)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session; its URL."""
    with scratch_database(PG_ADMIN_URL, prefix="agentflow_test") as url:
        yield url


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database with no schema at all (for migration tests)."""
    with scratch_database(PG_ADMIN_URL, prefix="agentflow_empty", upgrade=False) as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_database(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh, migrated SQLite file for this test session; its URL."""
    path: Path = tmp_path_factory.mktemp("db") / "agentflow.db"
    url = f"sqlite+aiosqlite:///{path}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test that uses this runs on both databases."""
    name = "sqlite_database" if request.param == "sqlite" else "pg_database"
    return str(request.getfixturevalue(name))


@pytest.fixture
async def db_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    """A Docker engine that answers (started for this session if none did)."""
    from tests.support.docker_engine import docker_engine as engine

    yield from engine()


@pytest.fixture(scope="session")
def sandbox_runtime_image(docker_engine: None) -> str:
    """The Docker sandboxes' image, built (or found in the engine's cache) from this checkout."""
    from agentflow.stack import build_sandbox_runtime_image

    return build_sandbox_runtime_image(Path(__file__).resolve().parents[1])
