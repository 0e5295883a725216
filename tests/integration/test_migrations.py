"""The migrations are the schema: they apply and revert cleanly and match the models."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from agentflow.db import migrate
from agentflow.db.models import Base
from agentflow.db.packing import pack_ints, pack_mask
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


async def _seed_at_0004(url: str) -> tuple[uuid.UUID, uuid.UUID]:
    """A finished episode with two policy turns (versions 3..5) and one with none, written
    as a 0004 database holds them."""
    engine = create_engine(url)
    sampled, unsampled = uuid.uuid4(), uuid.uuid4()
    now = datetime.now(UTC)
    try:
        async with engine.begin() as conn:
            for episode in (sampled, unsampled):
                await conn.execute(
                    text(
                        "INSERT INTO episodes (id, env_ref, task, status, created_at) "
                        "VALUES (:id, 'e', '{}', 'running', :now)"
                    ),
                    {"id": _uuid_param(url, episode), "now": now},
                )
            rows = [
                (sampled, None, pack_ints([4, 3])),
                (sampled, None, pack_ints([5])),
                (unsampled, None, None),
            ]
            for episode, parent, versions in rows:
                await conn.execute(
                    text(
                        "INSERT INTO turns (id, episode_id, parent_id, depth, kind, token_ids, "
                        "weight_versions, loss_mask, timings, created_at) VALUES (:id, :episode, "
                        ":parent, 0, :kind, :tokens, :versions, :mask, '{}', :now)"
                    ),
                    {
                        "id": _uuid_param(url, uuid.uuid4()),
                        "episode": _uuid_param(url, episode),
                        "parent": parent,
                        "kind": "policy" if versions else "prompt",
                        "tokens": pack_ints([1]),
                        "versions": versions,
                        "mask": pack_mask([1]),
                        "now": now,
                    },
                )
            await conn.execute(text("UPDATE episodes SET status = 'completed'"))
    finally:
        await engine.dispose()
    return sampled, unsampled


def _uuid_param(url: str, value: uuid.UUID) -> object:
    # SQLAlchemy's Uuid stores hex without dashes on SQLite; PostgreSQL takes the UUID.
    return value.hex if url.startswith("sqlite") else value


async def _version_range(url: str, episode: uuid.UUID) -> tuple[int | None, int | None]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT min_weight_version, max_weight_version FROM episodes WHERE id = :id"
                    ),
                    {"id": _uuid_param(url, episode)},
                )
            ).one()
    finally:
        await engine.dispose()
    return row[0], row[1]


def test_0005_fills_in_finished_episodes_version_ranges(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0004")
    sampled, unsampled = asyncio.run(_seed_at_0004(empty_url))
    migrate.upgrade(empty_url)
    assert asyncio.run(_version_range(empty_url, sampled)) == (3, 5)
    assert asyncio.run(_version_range(empty_url, unsampled)) == (None, None)
    migrate.downgrade(empty_url, "0004")
    migrate.upgrade(empty_url)
    _, diff = asyncio.run(_tables_and_diff(empty_url))
    assert diff == []
