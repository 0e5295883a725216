"""Throw-away PostgreSQL databases for tests and benchmarks, made beside a maintenance one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from agentflow.db import migrate
from agentflow.db.session import create_engine

DEFAULT_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


async def _admin(admin_url: str, sql: str) -> None:
    engine = create_engine(admin_url)
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.exec_driver_sql(sql)
    await engine.dispose()


@contextmanager
def scratch_database(
    admin_url: str = DEFAULT_ADMIN_URL, *, prefix: str = "agentflow_scratch", upgrade: bool = True
) -> Iterator[str]:
    """Create a uniquely named database (migrated unless `upgrade=False`), yield its URL,
    drop it afterwards. Blocking: call it outside a running event loop."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    try:
        url = admin_url.rsplit("/", 1)[0] + "/" + name
        if upgrade:
            migrate.upgrade(url)
        yield url
    finally:
        asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
