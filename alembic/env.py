"""Alembic environment: runs migrations on the async engine of the configured database."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from agentflow.config import Settings
from agentflow.db.models import Base
from agentflow.db.session import create_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    # An explicit URL (set by agentflow.db.migrate) wins over the environment.
    return config.get_main_option("sqlalchemy.url") or Settings().database_url


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things in place
        compare_type=True,
    )


def run_migrations_offline() -> None:
    _configure(url=_url())
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # handed over by a caller that already holds one
        _run_sync(connection)
        return
    engine = create_engine(_url())
    async with engine.connect() as conn:
        await conn.run_sync(_run_sync)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
