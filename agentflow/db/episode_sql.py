"""The statements of episodes' group commits, on SQLAlchemy or straight on asyncpg.

`TurnTree` batches concurrent episode creates and ends (`agentflow.db.group_commit`) and
writes each batch with a handful of statements. On PostgreSQL those run on asyncpg's own
prepared statements inside its own transaction: SQLAlchemy's statement and parameter
handling (and the greenlet hops of its async layer) cost more CPU than the statements,
and a run ends hundreds of episodes a second. SQLite, and batches with images or final
turns, take SQLAlchemy Core. Both sides implement `EpisodeStatements`; the logic that
decides what to write lives once, in `TurnTree`.

What SQLAlchemy's column types do on the way in is done here for asyncpg: storable text
and JSON (`agentflow.db.storable`), JSON serialized (`agentflow.db.direct` runs them).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from agentflow.db import direct
from agentflow.db.models import Episode, Trajectory, Turn
from agentflow.db.storable import storable, storable_json

_episodes = cast(Table, Episode.__table__)
_turns = cast(Table, Turn.__table__)
_trajectories = cast(Table, Trajectory.__table__)


class LockedEpisode(NamedTuple):
    id: uuid.UUID
    run_id: uuid.UUID | None
    status: str


class TreeTurn(NamedTuple):
    """What an episode's end needs of each of its turns."""

    episode_id: uuid.UUID
    id: uuid.UUID
    parent_id: uuid.UUID | None
    weight_versions: bytes | None


# The columns an episode's end sets, as `end_episodes` takes them per episode.
END_FIELDS = (
    "status",
    "reward",
    "error",
    "finished_at",
    "min_weight_version",
    "max_weight_version",
)


class EpisodeStatements(Protocol):
    async def insert_episodes(self, rows: Sequence[dict[str, Any]]) -> None: ...

    async def lock_episodes(self, ids: Sequence[uuid.UUID]) -> list[LockedEpisode]:
        """The rows of `ids` that exist, locked (on PostgreSQL) in id order."""
        ...

    async def episode_turns(self, ids: Sequence[uuid.UUID]) -> list[TreeTurn]:
        """The turns of the episodes `ids`, parents first."""
        ...

    async def end_episodes(self, ends: Sequence[dict[str, Any]]) -> None:
        """Set `END_FIELDS` of each `{"id": ..., **END_FIELDS}`."""
        ...

    async def insert_trajectories(self, rows: Sequence[dict[str, Any]]) -> None: ...


_LOCK = (
    select(_episodes.c.id, _episodes.c.run_id, _episodes.c.status)
    .where(_episodes.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(_episodes.c.id)
    .with_for_update()
)
_TREE = (
    select(_turns.c.episode_id, _turns.c.id, _turns.c.parent_id, _turns.c.weight_versions)
    .where(_turns.c.episode_id.in_(bindparam("ids", expanding=True)))
    .order_by(_turns.c.depth, _turns.c.created_at, _turns.c.id)
)
_END = (
    update(_episodes)
    .where(_episodes.c.id == bindparam("episode_id"))
    .values({name: bindparam(f"new_{name}") for name in END_FIELDS})
)


class AlchemyStatements:
    """Over a SQLAlchemy connection (in a transaction where one is needed)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    async def insert_episodes(self, rows: Sequence[dict[str, Any]]) -> None:
        await self.conn.execute(insert(_episodes), list(rows))

    async def lock_episodes(self, ids: Sequence[uuid.UUID]) -> list[LockedEpisode]:
        rows = await self.conn.execute(_LOCK, {"ids": list(ids)})
        return [LockedEpisode(*row) for row in rows]

    async def episode_turns(self, ids: Sequence[uuid.UUID]) -> list[TreeTurn]:
        rows = await self.conn.execute(_TREE, {"ids": list(ids)})
        return [TreeTurn(*row) for row in rows]

    async def end_episodes(self, ends: Sequence[dict[str, Any]]) -> None:
        params = [
            {"episode_id": end["id"], **{f"new_{name}": end[name] for name in END_FIELDS}}
            for end in ends
        ]
        await self.conn.execute(_END, params)

    async def insert_trajectories(self, rows: Sequence[dict[str, Any]]) -> None:
        await self.conn.execute(insert(_trajectories), list(rows))


_EPISODE_COLUMNS = ("id", "run_id", "environment_id", "env_ref", "task", "group_id", "status")
_EPISODE_INSERT = direct.Insert(_episodes, (*_EPISODE_COLUMNS, "created_at"))
_TRAJECTORY_COLUMNS = tuple(c.name for c in _trajectories.columns)
_TRAJECTORY_INSERT = direct.Insert(_trajectories, _TRAJECTORY_COLUMNS)
_LOCK_SQL = (
    "SELECT id, run_id, status FROM episodes WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE"
)
_TREE_SQL = (
    "SELECT episode_id, id, parent_id, weight_versions FROM turns "
    "WHERE episode_id = ANY($1::uuid[]) ORDER BY depth, created_at, id"
)
_END_SQL = (
    "UPDATE episodes SET "
    + ", ".join(f"{name} = ${i}" for i, name in enumerate(END_FIELDS, start=2))
    + " WHERE id = $1"
)


class AsyncpgStatements:
    """Straight on an asyncpg connection (inside its own transaction)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def insert_episodes(self, rows: Sequence[dict[str, Any]]) -> None:
        records = [
            (
                *(row[name] for name in _EPISODE_COLUMNS[:4]),
                storable_json(row["task"]),
                row["group_id"],
                row["status"],
                row["created_at"],
            )
            for row in rows
        ]
        await _EPISODE_INSERT.run(self.driver, records)

    async def lock_episodes(self, ids: Sequence[uuid.UUID]) -> list[LockedEpisode]:
        return [LockedEpisode(*row) for row in await self.driver.fetch(_LOCK_SQL, list(ids))]

    async def episode_turns(self, ids: Sequence[uuid.UUID]) -> list[TreeTurn]:
        return [TreeTurn(*row) for row in await self.driver.fetch(_TREE_SQL, list(ids))]

    async def end_episodes(self, ends: Sequence[dict[str, Any]]) -> None:
        records = [
            (
                end["id"],
                end["status"],
                end["reward"],
                None if end["error"] is None else storable(end["error"]),
                *(end[name] for name in END_FIELDS[3:]),
            )
            for end in ends
        ]
        await direct.executemany(self.driver, _END_SQL, records)

    async def insert_trajectories(self, rows: Sequence[dict[str, Any]]) -> None:
        await _TRAJECTORY_INSERT.run(
            self.driver,
            [tuple(row.get(name) for name in _TRAJECTORY_COLUMNS) for row in rows],
        )
