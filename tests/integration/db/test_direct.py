"""`agentflow.db.direct` on a real PostgreSQL: the group commits' own connections
(`HeldConnection`: one the server closed is replaced, and the writes go on) and
their inserts (`Insert`: every row or none)."""

from __future__ import annotations

import asyncio
import uuid
from typing import cast

import asyncpg
import pytest
from sqlalchemy import Table
from sqlalchemy.exc import IntegrityError

from agentflow.db import direct
from agentflow.db.models import Episode
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.types import TurnRecord

pytestmark = pytest.mark.integration


async def _end_other_connections(url: str) -> int:
    """End every connection to the database but this one (as a restart would)."""
    admin = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        ended: int = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await admin.close()
    return ended


@pytest.mark.parametrize("idle_s", [0.0, 0.3], ids=["held", "pooled"])
async def test_a_connection_the_server_closed_is_replaced(pg_database: str, idle_s: float) -> None:
    """Held: ended while its group commit still keeps it (between two writes of a
    trickle). Pooled: ended after the group commit gave it back."""
    engine = create_engine(pg_database)
    try:
        tree = TurnTree(session_factory(engine))
        episode = await tree.create_episode(env_ref="test/closed-v0")
        root = await tree.add_turn(episode, None, TurnRecord(kind="prompt", token_ids=(1, 2)))
        await asyncio.sleep(idle_s)
        assert await _end_other_connections(pg_database) >= 1
        await asyncio.sleep(0.2)  # the client sees its sockets close

        child = await tree.add_turn(episode, root, TurnRecord(kind="env", token_ids=(3,)))
        path = await tree.path(child)
        assert [turn.token_ids for turn in path] == [(1, 2), (3,)]
        await tree.complete_episode(episode, "completed", 1.0)
        assert (await tree.episode(episode)).status == "completed"
    finally:
        await engine.dispose()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 300])
async def test_an_insert_writes_every_row_or_none(pg_database: str, rows: int) -> None:
    """Up to eight rows go as one statement, more as executemany: every row lands with
    its values either way, and a batch with a refused row writes nothing."""
    episodes = cast(Table, Episode.__table__)
    insert = direct.Insert(episodes, ("id", "env_ref", "task", "status", "created_at"))
    driver = await asyncpg.connect(pg_database.replace("postgresql+asyncpg", "postgresql"))
    try:
        now = await driver.fetchval("SELECT now()")
        ids = [uuid.uuid4() for _ in range(rows)]
        records = [(i, f"test/insert-{n}", "{}", "running", now) for n, i in enumerate(ids)]
        await insert.run(driver, records)
        stored = await driver.fetch(
            "SELECT id, env_ref FROM episodes WHERE id = ANY($1::uuid[])", ids
        )
        assert {(r["id"], r["env_ref"]) for r in stored} == {(i, e) for i, e, *_ in records}

        again = [(uuid.uuid4(), "test/new", "{}", "running", now) for _ in range(rows)]
        with pytest.raises(IntegrityError):
            await insert.run(driver, [*again, records[0]])  # the last one's id is taken
        found = await driver.fetchval(
            "SELECT count(*) FROM episodes WHERE id = ANY($1::uuid[])", [r[0] for r in again]
        )
        assert found == 0
    finally:
        await driver.close()
