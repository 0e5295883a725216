"""Run Alembic migrations from code, and refuse to serve a database whose schema is behind."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.errors import SchemaOutOfDate


@cache
def script_location() -> Path:
    """The Alembic script directory (`env.py`, `script.py.mako`, `versions/`) of this package.

    It ships as package data, `agentflow/_migrations`: in the source tree a symlink to the
    top-level `alembic/`, in a wheel a copy of it (docs/decisions.md, "How migrations ship").
    """
    location = resources.files("agentflow") / "_migrations"
    if not isinstance(location, Path) or not (location / "env.py").is_file():
        raise RuntimeError(
            f"agentflow's migrations are missing from the installed package ({location}); "
            "reinstall agentflow"
        )
    return location


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (blocking; runs its own event loop)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory(str(script_location())).get_current_head()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision()
        )


async def ensure_schema_current(engine: AsyncEngine) -> None:
    """Raise `SchemaOutOfDate`, naming the command to run, unless the schema is at head."""
    current, head = await current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at revision {current or 'empty'}, code needs {head}: "
            "run `agentflow db upgrade`"
        )
