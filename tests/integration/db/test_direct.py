"""The group commits' own connections (`agentflow.db.direct.HeldConnection`) on a real
PostgreSQL: one the server closed is replaced, and the writes go on."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

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
