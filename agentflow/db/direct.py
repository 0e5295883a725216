"""Statements straight on asyncpg, for the group commits that PostgreSQL runs hundreds
of times a second (`turn_sql`, `episode_sql`): SQLAlchemy's statement and parameter
handling cost more CPU than the statements. What the column types would do on the way
in is the caller's; a refused row is raised as SQLAlchemy's `IntegrityError`, so callers
explain it as on the SQLAlchemy path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.exc import IntegrityError


def insert_sql(table: Table, columns: Sequence[str]) -> str:
    """`INSERT INTO table (columns) VALUES ($1, ...)`."""
    marks = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    return f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({marks})"


async def executemany(driver: Any, sql: str, records: Sequence[tuple[Any, ...]]) -> None:
    """`sql` once per record on the asyncpg connection `driver` (atomic: asyncpg wraps an
    executemany outside a transaction in one)."""
    import asyncpg  # only with the asyncpg driver

    try:
        await driver.executemany(sql, records)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(sql, None, exc) from exc
