"""The SQL of the turn tree: batch insert with tree checks, and recursive path reads.

Plain async functions over a session, used by `agentflow.db.turn_tree.TurnTree`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import Select, Table, bindparam, select
from sqlalchemy import insert as sql_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker

from agentflow.db import direct, id_lists, turn_images, turn_rows
from agentflow.db.blobs import BlobStore, DatabaseBlobStore, stored_ids
from agentflow.db.models import Episode, Trajectory, Turn
from agentflow.db.storable import storable, storable_json
from agentflow.errors import Conflict, InvalidInput, NotFound
from agentflow.types import NewTurn, TurnRecord

turns = cast(Table, Turn.__table__)
episodes = cast(Table, Episode.__table__)
trajectories = cast(Table, Trajectory.__table__)
# Raised by the database trigger that keeps turns out of finished episodes.
FINISHED_EPISODE_MESSAGE = "episode is finished: it takes no more turns"
_CHUNK = 500  # ids per IN (...) list: far below every bind-parameter limit

# Columns a context needs; a path needs all of them.
CONTEXT_COLUMNS = (
    "id",
    "parent_id",
    "depth",
    "token_ids",
    "logprobs",
    "weight_versions",
    "loss_mask",
)
TURN_COLUMNS = tuple(c.name for c in turns.columns)
# A trajectory's path: its context and each turn's reward (returns-to-go, `trainer.credit`).
TRAJECTORY_COLUMNS = (*CONTEXT_COLUMNS, "reward")


def chunks(ids: Sequence[uuid.UUID]) -> Iterable[Sequence[uuid.UUID]]:
    for start in range(0, len(ids), _CHUNK):
        yield ids[start : start + _CHUNK]


Placement = tuple[uuid.UUID, int]  # a written turn's (episode id, depth)


def _positions(batch: Sequence[NewTurn]) -> dict[uuid.UUID, int]:
    """Each turn's index in `batch`; refuses a batch of anything but `TurnRecord`s or
    with a turn id twice."""
    positions: dict[uuid.UUID, int] = {}
    for index, turn in enumerate(batch):
        if not isinstance(turn.record, TurnRecord):
            raise InvalidInput("each turn needs a TurnRecord", field=("turns", str(index)))
        if turn.id in positions:
            raise InvalidInput(
                f"turn id {turn.id} appears twice in the batch",
                field=("turns", str(index), "id"),
            )
        positions[turn.id] = index
    return positions


def _outside(
    batch: Sequence[NewTurn],
    positions: Mapping[uuid.UUID, int],
    known: Mapping[uuid.UUID, turn_rows.WrittenTurn],
    stored: dict[uuid.UUID, Placement],
) -> list[uuid.UUID]:
    """Parents outside the batch: those in `known` go to `stored`, the others (to read)
    are returned."""
    outside = []
    for t in batch:
        if t.parent_id is None or t.parent_id in positions:
            continue
        parent = known.get(t.parent_id)
        if parent is not None:
            stored[t.parent_id] = (parent.episode_id, parent.depth)
        else:
            outside.append(t.parent_id)
    return turn_rows.ids_in_order(outside)


def _depths(
    batch: Sequence[NewTurn],
    positions: Mapping[uuid.UUID, int],
    stored: Mapping[uuid.UUID, Placement],
) -> list[int]:
    """Each turn's depth, after the tree checks: its parent exists (earlier in the batch
    or stored) and is in the same episode."""
    depths: dict[uuid.UUID, int] = {}
    out = []
    for index, turn in enumerate(batch):
        depth = 0
        if turn.parent_id is not None:
            where = ("turns", str(index), "parent_id")
            if turn.parent_id in depths:
                parent_episode = batch[positions[turn.parent_id]].episode_id
                depth = depths[turn.parent_id] + 1
            elif turn.parent_id in positions:
                raise InvalidInput(
                    f"parent {turn.parent_id} comes after its child in the batch", field=where
                )
            elif turn.parent_id in stored:
                parent_episode, parent_depth = stored[turn.parent_id]
                depth = parent_depth + 1
            else:
                raise NotFound(f"parent turn {turn.parent_id} not found")
            if parent_episode != turn.episode_id:
                raise InvalidInput(
                    f"parent turn {turn.parent_id} belongs to episode {parent_episode}, "
                    f"not {turn.episode_id}",
                    field=where,
                )
        depths[turn.id] = depth
        out.append(depth)
    return out


async def insert_turns(
    session: AsyncSession | AsyncConnection,
    batch: Sequence[NewTurn],
    placed: Mapping[uuid.UUID, turn_rows.WrittenTurn] | None = None,
    blob_store: BlobStore | None = None,
) -> list[turn_rows.WrittenTurn]:
    """Insert `batch` (parents before children) with one executemany, after checking the
    tree: parents exist and share the child's episode; depth = parent's + 1. `placed`
    holds turns already known to be stored (turns never move), which saves reading them
    back; returns every turn written, as written. Turns' images go to `blob_store`
    (default: the database) and are linked; a batch with images needs a transaction.
    `insert_turns_direct` is the same on an asyncpg connection, for batches without images."""
    positions = _positions(batch)
    # Parents outside the batch: turns are never updated, so reading them needs no lock.
    stored: dict[uuid.UUID, Placement] = {}
    for chunk in chunks(_outside(batch, positions, placed or {}, stored)):
        rows = await session.execute(
            select(turns.c.id, turns.c.episode_id, turns.c.depth).where(turns.c.id.in_(chunk))
        )
        stored.update({row.id: (row.episode_id, row.depth) for row in rows})
    depths = _depths(batch, positions, stored)
    now = datetime.now(UTC)
    # Distinct timestamps keep siblings written in one batch in their written order.
    values = [
        turn_rows.turn_values(turn, depth, now + timedelta(microseconds=index))
        for index, (turn, depth) in enumerate(zip(batch, depths, strict=True))
    ]
    rows_out = [dict(zip(turn_rows.TURN_ROW_COLUMNS, row, strict=True)) for row in values]
    links = []
    if turn_images.has_images(batch):
        links = await turn_images.store_blobs(session, blob_store or DatabaseBlobStore(), batch)
    await session.execute(sql_insert(turns), rows_out)
    await turn_images.link(session, links)
    # That the episode is still open is checked by the database as each row goes in
    # (trigger `turns_need_open_episode`, migration 0002), atomically with the insert.
    return [turn_rows.written_turn(row) for row in values]


_INSERT_TURN_ROWS = direct.Insert(turns, turn_rows.TURN_ROW_COLUMNS)
_TEXT = turn_rows.TURN_ROW_COLUMNS.index("text")
_TIMINGS = turn_rows.TURN_ROW_COLUMNS.index("timings")
_PLACEMENTS_SQL = "SELECT id, episode_id, depth FROM turns WHERE id = ANY($1::uuid[])"


async def insert_turns_direct(
    driver: Any,
    batch: Sequence[NewTurn],
    placed: Mapping[uuid.UUID, turn_rows.WrittenTurn] | None = None,
) -> list[turn_rows.WrittenTurn]:
    """`insert_turns` for a batch without images, straight on the asyncpg connection
    `driver` outside a transaction (`agentflow.db.direct`): the batch is one statement,
    atomic by itself, so it needs no BEGIN and COMMIT. What the column types do on the
    way in is done here (text and JSON made storable, JSON serialized)."""
    positions = _positions(batch)
    stored: dict[uuid.UUID, Placement] = {}
    outside = _outside(batch, positions, placed or {}, stored)
    if outside:
        rows = await driver.fetch(_PLACEMENTS_SQL, outside)
        stored.update({row[0]: (row[1], row[2]) for row in rows})
    depths = _depths(batch, positions, stored)
    now = datetime.now(UTC)
    records = []
    written = []
    for index, (turn, depth) in enumerate(zip(batch, depths, strict=True)):
        values = turn_rows.turn_values(turn, depth, now + timedelta(microseconds=index))
        written.append(turn_rows.written_turn(values))
        text, timings = values[_TEXT], values[_TIMINGS]
        records.append(
            (
                *values[:_TEXT],
                None if text is None else storable(text),
                *values[_TEXT + 1 : _TIMINGS],
                storable_json(timings),
                *values[_TIMINGS + 1 :],
            )
        )
    await _INSERT_TURN_ROWS.run(driver, records)
    return written


async def explain_insert_failure(
    sessions: async_sessionmaker[AsyncSession], batch: Sequence[NewTurn], exc: IntegrityError
) -> Exception:
    """Name what made an insert fail: a finished or missing episode, a turn id used, or
    an image named by a blob id that is not stored."""
    if FINISHED_EPISODE_MESSAGE in str(exc.orig):
        return Conflict(f"{FINISHED_EPISODE_MESSAGE} (one of {len(batch)} turns written)")
    episode_ids = turn_rows.ids_in_order([t.episode_id for t in batch])
    turn_ids = [t.id for t in batch]
    refs = list(dict.fromkeys(i for t in batch for i in t.record.images if isinstance(i, str)))
    async with sessions() as session:
        missing_blobs = set(refs) - await stored_ids(session, refs)
        if missing_blobs:
            return NotFound(f"blob {sorted(missing_blobs)[0]} not found")
        for chunk in chunks(episode_ids):
            found = set(
                await session.scalars(select(episodes.c.id).where(episodes.c.id.in_(chunk)))
            )
            missing = [e for e in chunk if e not in found]
            if missing:
                return NotFound(f"episode {missing[0]} not found")
        for chunk in chunks(turn_ids):
            taken = list(await session.scalars(select(turns.c.id).where(turns.c.id.in_(chunk))))
            if taken:
                return Conflict(f"turn id {taken[0]} is already used")
    return Conflict(f"turns conflict with stored data: {exc.orig}")


def _path_query(columns: Sequence[str]) -> Select[Any]:
    """Root-first paths of the turns whose ids are bound to `ids`, one row per turn on a
    path, tagged with the turn it leads to (`leaf_id`). Built once: building a CTE costs
    more than running it."""
    carried = [name for name in columns if name not in ("id", "parent_id", "depth")]
    seed = select(
        turns.c.id.label("leaf_id"),
        turns.c.id,
        turns.c.parent_id,
        turns.c.depth,
        *(turns.c[name] for name in carried),
    ).where(turns.c.id.in_(bindparam("ids", expanding=True)))
    path = seed.cte("path", recursive=True)
    parent = turns.alias("parent")
    path = path.union_all(
        select(
            path.c.leaf_id,
            parent.c.id,
            parent.c.parent_id,
            parent.c.depth,
            *(parent.c[name] for name in carried),
        ).where(parent.c.id == path.c.parent_id)
    )
    return select(path).order_by(path.c.leaf_id, path.c.depth)


_PATH_QUERIES = {
    columns: _path_query(columns) for columns in (CONTEXT_COLUMNS, TRAJECTORY_COLUMNS, TURN_COLUMNS)
}


def _episode_turns_query(columns: Sequence[str]) -> id_lists.ByDialect[Select[Any]]:
    """Every turn of the episodes bound to `ids` (each turn's id, parent and `columns`)."""
    names = dict.fromkeys(("id", "parent_id", *columns))
    return id_lists.both(
        lambda array: select(*(turns.c[name] for name in names)).where(
            id_lists.id_match(turns.c.episode_id, "ids", array=array)
        )
    )


_EPISODE_TURNS_QUERIES: dict[tuple[str, ...], id_lists.ByDialect[Select[Any]]] = {
    TRAJECTORY_COLUMNS: _episode_turns_query(TRAJECTORY_COLUMNS)  # a lease's, the one caller
}


async def episode_paths(
    session: AsyncSession, leaves: Mapping[uuid.UUID, uuid.UUID], columns: Sequence[str]
) -> dict[uuid.UUID, list[Any]]:
    """The root-first path of each leaf turn in `leaves` (leaf id -> its episode id), from
    its episode's turns, read by the episode index and linked here: a path never leaves
    its episode. For many leaves at once (a trainer's lease), where the recursive query
    of `paths` can be planned as a hash join over a scan of the whole turns table, whose
    cost grows with every turn the run has written (`bench/trajectory_paths.py`).
    Unknown leaves are absent."""
    conn = await session.connection()
    query = _EPISODE_TURNS_QUERIES[tuple(columns)].on(conn)
    by_id: dict[uuid.UUID, Any] = {}
    for chunk in chunks(list(dict.fromkeys(leaves.values()))):
        for row in await conn.execute(query, {"ids": list(chunk)}):
            by_id[row.id] = row
    found: dict[uuid.UUID, list[Any]] = {}
    for leaf in leaves:
        path = []
        turn = by_id.get(leaf)
        while turn is not None:
            path.append(turn)
            turn = None if turn.parent_id is None else by_id.get(turn.parent_id)
        if path:
            path.reverse()
            found[leaf] = path
    return found


async def paths(
    session: AsyncSession, turn_ids: Sequence[uuid.UUID], columns: Sequence[str]
) -> dict[uuid.UUID, list[Any]]:
    """The root-first path of every turn in `turn_ids` (`columns` is `CONTEXT_COLUMNS`,
    `TRAJECTORY_COLUMNS` or `TURN_COLUMNS`), one recursive query per chunk. Unknown turns
    are absent."""
    query = _PATH_QUERIES[tuple(columns)]
    conn = await session.connection()  # Core, not the ORM: this is a hot read path
    found: dict[uuid.UUID, list[Any]] = defaultdict(list)
    for chunk in chunks(turn_ids):
        for row in await conn.execute(query, {"ids": list(chunk)}):
            found[row.leaf_id].append(row)
    return found
