"""The migrations are the schema: they apply and revert cleanly and match the models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from agentflow.db import migrate
from agentflow.db.models import Base
from agentflow.db.session import create_engine
from agentflow.errors import SchemaOutOfDate

pytestmark = pytest.mark.integration


async def _tables_and_diff(url: str) -> tuple[set[str], list[object]]:
    engine = create_engine(url)
    async with engine.connect() as conn:

        def inspect_sync(sync_conn):  # type: ignore[no-untyped-def]
            context = MigrationContext.configure(sync_conn, opts={"compare_type": True})
            return set(inspect(sync_conn).get_table_names()), compare_metadata(
                context, Base.metadata
            )

        tables, diff = await conn.run_sync(inspect_sync)
    await engine.dispose()
    return tables, diff


async def _check_current(url: str) -> None:
    engine = create_engine(url)
    try:
        await migrate.ensure_schema_current(engine)
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
    return str(request.getfixturevalue("empty_pg_url"))


def test_upgrade_downgrade_and_models_agree(empty_url: str) -> None:
    with pytest.raises(SchemaOutOfDate, match="agentflow db upgrade"):
        asyncio.run(_check_current(empty_url))

    migrate.upgrade(empty_url)
    tables, diff = asyncio.run(_tables_and_diff(empty_url))
    assert set(Base.metadata.tables) <= tables
    assert diff == []  # autogenerate finds nothing the migrations missed
    asyncio.run(_check_current(empty_url))

    migrate.downgrade(empty_url, "base")
    tables, _ = asyncio.run(_tables_and_diff(empty_url))
    assert tables <= {"alembic_version"}
    migrate.upgrade(empty_url)  # and back up again from base


def test_0004_blobs_go_down_and_up_alone(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    tables, _ = asyncio.run(_tables_and_diff(empty_url))
    assert {"blobs", "blob_data", "turn_blobs"} <= tables
    migrate.downgrade(empty_url, "0003")
    tables, _ = asyncio.run(_tables_and_diff(empty_url))
    assert not {"blobs", "blob_data", "turn_blobs"} & tables
    assert {"turns", "trajectories"} <= tables
    migrate.upgrade(empty_url)
    tables, diff = asyncio.run(_tables_and_diff(empty_url))
    assert {"blobs", "blob_data", "turn_blobs"} <= tables and diff == []
