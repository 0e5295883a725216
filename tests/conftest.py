"""Shared fixtures: real databases with the migrations applied.

PostgreSQL tests run against the server at 127.0.0.1:5432 (trust auth). Each test
session makes its own database (from the `test` maintenance database) and drops it
afterwards, so parallel runs and other users of the server never collide.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db import migrate
from agentflow.db.session import create_engine

PG_ADMIN_URL = os.environ.get(
    "AGENTFLOW_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


async def _admin(sql: str) -> None:
    engine = create_engine(PG_ADMIN_URL)
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.exec_driver_sql(sql)
    await engine.dispose()


def _pg_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session; its URL."""
    name = f"agentflow_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    url = _pg_url(name)
    migrate.upgrade(url)
    yield url
    asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database with no schema at all (for migration tests)."""
    name = f"agentflow_empty_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    yield _pg_url(name)
    asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


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
