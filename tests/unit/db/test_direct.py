"""Which endings leave a group commit's connection unsound (`agentflow.db.direct`)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy.exc import IntegrityError

from agentflow.db import direct
from agentflow.errors import InvalidInput


@pytest.mark.parametrize(
    "exc",
    [
        asyncio.CancelledError(),
        asyncpg.ConnectionDoesNotExistError("gone"),
        asyncpg.InterfaceError("closed"),
        ConnectionResetError(),
        TimeoutError(),
    ],
)
def test_a_lost_or_cancelled_connection_is_not_pooled_again(exc: BaseException) -> None:
    assert direct._lost(exc)


@pytest.mark.parametrize(
    "exc",
    [
        IntegrityError("INSERT", None, Exception("duplicate key")),
        asyncpg.UniqueViolationError("duplicate key"),
        InvalidInput("bad turn", field="turns"),
    ],
)
def test_a_refused_statement_leaves_the_connection_sound(exc: BaseException) -> None:
    assert not direct._lost(exc)
