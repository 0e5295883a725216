"""A `TurnTree` on each real database (SQLite file and PostgreSQL), migrations applied."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db.session import session_factory
from agentflow.db.turn_tree import TurnTree


@pytest.fixture
def turn_tree(db_engine: AsyncEngine) -> TurnTree:
    return TurnTree(session_factory(db_engine))
