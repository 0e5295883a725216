"""Async engine and session factory for the configured database."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import ConnectionPoolEntry


def create_engine(url: str, *, echo: bool = False, synchronous_commit: bool = False) -> AsyncEngine:
    """An async engine; SQLite gets WAL and foreign keys, which it does not enable by default."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, echo=echo, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    # No pre-ping: it costs a round trip on every checkout, i.e. on every turn batch. A
    # connection broken by a database restart fails its one statement, and SQLAlchemy then
    # replaces the pool's connections (`pool_recycle` bounds their age anyway).
    # Asynchronous commit by default: a commit returns before its WAL reaches the disk, so
    # a turn batch does not wait for an fsync. A crash of the gateway loses nothing; a
    # crash of the database server may lose the last fraction of a second of commits,
    # whole transactions at a time (never a half-written episode).
    settings = {"synchronous_commit": "on" if synchronous_commit else "off"}
    return create_async_engine(
        url,
        echo=echo,
        pool_size=20,
        max_overflow=20,
        pool_pre_ping=False,
        pool_recycle=1800,
        connect_args={"server_settings": settings},
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def read_connection(session: AsyncSession) -> AsyncConnection:
    """The session's connection in autocommit mode, for reads that write nothing.

    Under READ COMMITTED every statement takes its own snapshot whether or not a transaction
    wraps them, so a transaction around reads only adds a BEGIN and a ROLLBACK: two round
    trips to the database per request. Call this first thing in the session; the pool puts
    the connection back in its default mode when the session closes.
    """
    return await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
