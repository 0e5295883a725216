"""The group commits' own pool checkouts (`agentflow.db.direct.pooled_driver`) on a real
PostgreSQL: a connection the server dropped is closed, not pooled again."""

from __future__ import annotations

import asyncpg
import pytest

from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.types import TurnRecord

pytestmark = pytest.mark.integration


async def test_a_connection_the_server_dropped_is_replaced(pg_database: str) -> None:
    engine = create_engine(pg_database)
    try:
        tree = TurnTree(session_factory(engine))
        episode = await tree.create_episode(env_ref="test/dropped-v0")
        root = await tree.add_turn(episode, None, TurnRecord(kind="prompt", token_ids=(1, 2)))
        pool = engine.sync_engine.pool
        assert pool.checkedin() == 1  # one connection served both writes, and went back

        # The server ends that connection (as a restart or an idle timeout would).
        admin = await asyncpg.connect(pg_database.replace("postgresql+asyncpg", "postgresql"))
        try:
            ended = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND application_name = ''"
            )
        finally:
            await admin.close()
        assert ended >= 1

        # The write that meets the dead connection fails and closes it; the next gets a
        # new one, and nothing of the failed write was stored.
        with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)):
            await tree.add_turn(episode, root, TurnRecord(kind="env", token_ids=(3,)))
        child = await tree.add_turn(episode, root, TurnRecord(kind="env", token_ids=(4,)))
        path = await tree.path(child)
        assert [turn.token_ids for turn in path] == [(1, 2), (4,)]
        assert len(await tree.children(root)) == 1
    finally:
        await engine.dispose()
