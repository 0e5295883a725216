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

_ONE_STATEMENT_ROWS = 8  # rows an INSERT sends as one statement; more go as executemany


class Insert:
    """Rows of `columns` into `table`. Up to `_ONE_STATEMENT_ROWS` rows are one
    statement with that many VALUES lists (one Bind and Execute, prepared once per row
    count): about 15-20% less client CPU than asyncpg's executemany of the same rows, and
    a group commit's batches are mostly that small. More rows go as executemany, which
    pipelines them. Atomic either way (asyncpg runs an executemany outside a transaction
    in one)."""

    def __init__(self, table: Table, columns: Sequence[str]) -> None:
        names = ", ".join(columns)
        width = len(columns)

        def values(rows: int) -> str:
            return ", ".join(
                "(" + ", ".join(f"${row * width + i}" for i in range(1, width + 1)) + ")"
                for row in range(rows)
            )

        self.sql = [
            f"INSERT INTO {table.name} ({names}) VALUES {values(n)}"
            for n in range(_ONE_STATEMENT_ROWS + 1)
        ]

    async def run(self, driver: Any, records: Sequence[tuple[Any, ...]]) -> None:
        if not records:
            return
        if len(records) <= _ONE_STATEMENT_ROWS:
            sql = self.sql[len(records)]
            await execute(driver, sql, [value for record in records for value in record])
        else:
            await executemany(driver, self.sql[1], records)


async def execute(driver: Any, sql: str, args: Sequence[Any]) -> None:
    """`sql` with `args` on the asyncpg connection `driver`."""
    import asyncpg  # only with the asyncpg driver

    try:
        await driver.execute(sql, *args)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(sql, None, exc) from exc


async def executemany(driver: Any, sql: str, records: Sequence[tuple[Any, ...]]) -> None:
    """`sql` once per record on the asyncpg connection `driver` (atomic: asyncpg wraps an
    executemany outside a transaction in one)."""
    import asyncpg  # only with the asyncpg driver

    if len(records) == 1:  # one Bind/Execute: less work than executemany's pipeline
        await execute(driver, sql, records[0])
        return
    try:
        await driver.executemany(sql, records)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(sql, None, exc) from exc


def _lost(exc: BaseException) -> bool:
    """Whether a connection whose use ended in `exc` may be unsound: lost, or its user
    cancelled (perhaps mid-statement). A statement the server refused, or the caller's
    own check, leaves it sound."""
    import asyncpg  # only with the asyncpg driver

    lost = (
        asyncpg.PostgresConnectionError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,
        OSError,
        TimeoutError,
    )
    return not isinstance(exc, Exception) or isinstance(exc, lost)


_STALE_CHECKOUTS = 64  # closed connections skipped at most (a pool holds up to 40)


class Checkout:
    """An asyncpg connection taken from `engine`'s pool itself (about 55 µs of CPU here):
    an `AsyncConnection` and its switch to autocommit cost 140-210 µs per checkout, more
    than the statement a group commit then runs on it. Outside `driver.transaction()`
    asyncpg commits each statement by itself."""

    def __init__(self, engine: AsyncEngine, fairy: Any) -> None:
        self._engine = engine
        self._pool = engine.sync_engine.pool
        self._fairy = fairy
        self.driver: Any = fairy.driver_connection

    @classmethod
    async def take(cls, engine: AsyncEngine) -> Checkout:
        """A connection of the pool; one the server closed while it sat there (a restart,
        an idle timeout) is closed and the next taken, so it costs no write."""
        pool = engine.sync_engine.pool
        for _ in range(_STALE_CHECKOUTS):
            fairy = await greenlet_spawn(pool.connect)
            driver: Any = fairy.driver_connection
            if not driver.is_closed():
                break
            await greenlet_spawn(fairy.invalidate)
        return cls(engine, fairy)

    async def release(self, exc: BaseException | None = None) -> None:
        """Back to the pool; closed instead when `exc` ended its use and may have left it
        unsound (see `_lost`), so the next checkout gets a sound one, or when the engine
        was disposed meanwhile (its old pool would keep it open, unused)."""
        unsound = exc is not None and (_lost(exc) or self.driver.is_closed())
        if unsound or self._engine.sync_engine.pool is not self._pool:
            await greenlet_spawn(self._fairy.invalidate, exc)
        else:
            await greenlet_spawn(self._fairy.close)


class HeldConnection:
    """A `Checkout` kept across a group commit's batches, which run one at a time: while
    writes keep coming, each batch saves a checkout and a checkin. The group commit
    gives it back (`release`) when it has been idle a while; a batch that ended in a way
    that may have left it unsound closes it at once, and the next batch takes another.
    With `keep=False` each block's connection is given back after it (for writes outside
    a group commit, where nothing would call `release`)."""

    def __init__(self, engine: AsyncEngine, *, keep: bool = True) -> None:
        self.engine = engine
        self.keep = keep
        self._checkout: Checkout | None = None

    @contextlib.asynccontextmanager
    async def driver(self) -> AsyncIterator[Any]:
        checkout = self._checkout
        if checkout is None or checkout.driver.is_closed():
            if checkout is not None:  # the server closed it between batches
                self._checkout = None
                await checkout.release(ConnectionError("closed by the server"))
            checkout = self._checkout = await Checkout.take(self.engine)
        try:
            yield checkout.driver
        except BaseException as exc:
            if not self.keep or _lost(exc) or checkout.driver.is_closed():
                self._checkout = None
                await checkout.release(exc)
            raise
        if not self.keep:
            await self.release()

    async def release(self) -> None:
        checkout, self._checkout = self._checkout, None
        if checkout is not None:
            await checkout.release()
