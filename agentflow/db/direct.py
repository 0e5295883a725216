"""Statements straight on asyncpg, for the group commits that PostgreSQL runs hundreds
of times a second (`turn_sql`, `episode_sql`): SQLAlchemy's statement and parameter
handling cost more CPU than the statements. What the column types would do on the way
in is the caller's; a refused row is raised as SQLAlchemy's `IntegrityError`, so callers
explain it as on the SQLAlchemy path."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn


def insert_sql(table: Table, columns: Sequence[str]) -> str:
    """`INSERT INTO table (columns) VALUES ($1, ...)`."""
    marks = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    return f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({marks})"


async def executemany(driver: Any, sql: str, records: Sequence[tuple[Any, ...]]) -> None:
    """`sql` once per record on the asyncpg connection `driver` (atomic: asyncpg wraps an
    executemany outside a transaction in one)."""
    import asyncpg  # only with the asyncpg driver

    try:
        if len(records) == 1:  # one Bind/Execute: less work than executemany's pipeline
            await driver.execute(sql, *records[0])
        else:
            await driver.executemany(sql, records)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(sql, None, exc) from exc


@contextlib.asynccontextmanager
async def pooled_driver(engine: AsyncEngine) -> AsyncIterator[Any]:
    """An asyncpg connection from `engine`'s pool, checked out from the pool itself: an
    `AsyncConnection` and its switch to autocommit cost more CPU (about 140-210 µs per
    checkout) than the statement a group commit runs on it (about 55 µs here). Outside
    `driver.transaction()` asyncpg commits each statement by itself.

    A connection that was lost, or whose user was cancelled (perhaps mid-statement), is
    closed rather than pooled again, so the next checkout gets a sound one; a statement
    the server refused leaves it sound."""
    import asyncpg  # only with the asyncpg driver

    fairy = await greenlet_spawn(engine.sync_engine.pool.connect)
    driver: Any = fairy.driver_connection
    try:
        yield driver
    except BaseException as exc:
        lost = (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            OSError,
            TimeoutError,
        )
        if not isinstance(exc, Exception) or isinstance(exc, lost) or driver.is_closed():
            await greenlet_spawn(fairy.invalidate, exc)
        else:  # the server refused a statement, or the caller's own check failed: sound
            await greenlet_spawn(fairy.close)
        raise
    await greenlet_spawn(fairy.close)
