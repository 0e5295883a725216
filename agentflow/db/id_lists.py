"""Statements that match a list of ids, each in the form its database runs cheaply.

SQLAlchemy renders an expanding `IN` list afresh on every execution (a bound parameter
per id), and each length of list is a SQL string of its own: a new prepared statement on
asyncpg. A trainer's lease sends such lists several times a second, and their rendering
was a tenth of its CPU. On PostgreSQL one array parameter (`= ANY($1::UUID[])`) is one
statement for every length; SQLite has no arrays and keeps the expanding list. A
statement is built in both forms once, and the connection picks its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import ColumnElement, any_, bindparam
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

T = TypeVar("T")


@dataclass(frozen=True)
class ByDialect(Generic[T]):
    """A statement built with an array parameter (PostgreSQL) and with an expanding list."""

    array: T
    listed: T

    def on(self, conn: AsyncConnection) -> T:
        return self.array if conn.dialect.name == "postgresql" else self.listed


def both(build: Callable[[bool], T]) -> ByDialect[T]:
    """`build(array)` once with an array parameter and once with an expanding list."""
    return ByDialect(array=build(True), listed=build(False))


def id_match(column: Any, name: str, *, array: bool) -> ColumnElement[bool]:
    """`column` is one of the ids bound to `name` (a list of them)."""
    if array:
        return column == any_(bindparam(name, type_=ARRAY(column.type)))
    return column.in_(bindparam(name, expanding=True))
