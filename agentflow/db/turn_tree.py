"""`TurnTree`: the repository of episodes, their turn trees and their trajectories.

A turn appends a segment of tokens to its parent's context; the context of any turn is
rebuilt in one query (a recursive CTE walking parent links, which both PostgreSQL and
SQLite run). Writes go through SQLAlchemy Core with one executemany per batch, never the
ORM unit of work: rollouts write thousands of turns per second.

Consistency rules, enforced here on both databases:
- a parent exists before its child and belongs to the same episode; depth = parent + 1;
- no turn is added to a finished episode (checked after the insert, under a share lock
  on PostgreSQL and the write lock on SQLite, so a racing `complete_episode` either sees
  the new turns or makes the insert fail);
- `complete_episode` sets the final status and creates the trajectories in one
  transaction, and only once: a trajectory never points at a missing turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, exists, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from agentflow.db import blobs, turn_images, turn_rows, turn_sql
from agentflow.db.blobs import BlobInfo, BlobStore, DatabaseBlobStore
from agentflow.db.models import Environment, Run
from agentflow.db.turn_batcher import TurnBatcher
from agentflow.errors import Conflict, InvalidInput, NotFound
from agentflow.types import (
    FINAL_EPISODE_STATUSES,
    OPEN_EPISODE_STATUSES,
    TRAINABLE_EPISODE_STATUSES,
    Context,
    EpisodeInfo,
    EpisodeStatus,
    EpisodeTree,
    NewTurn,
    StoredTurn,
    TurnNode,
    TurnRecord,
)
from agentflow.types import Trajectory as TrajectoryView

_turns = turn_sql.turns
_episodes = turn_sql.episodes
_trajectories = turn_sql.trajectories
_runs = cast(Table, Run.__table__)
_environments = cast(Table, Environment.__table__)


def _check_text(name: str, value: str | None, max_length: int | None) -> None:
    if value is None:
        return
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(f"{name} is longer than {max_length} characters", field=name)
    if "\x00" in value:  # PostgreSQL text cannot hold NUL; refuse it on SQLite too
        raise InvalidInput(f"{name} must not contain NUL characters", field=name)


_PLACED_LIMIT = 100_000  # recent turns whose (episode, depth) is kept in memory


class TurnTree:
    """Episodes, turn trees and trajectories over an async session factory. Turns' images
    are kept in `blob_store` (default: the database; the gateway passes the configured
    one, `agentflow.db.blobs.blob_store_for`)."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], *, blob_store: BlobStore | None = None
    ) -> None:
        self._sessions = sessions
        self.blob_store: BlobStore = blob_store or DatabaseBlobStore()
        self.sessions = sessions  # for callers that also need plain sessions
        bind = sessions.kw.get("bind")
        # SQLite has one writer at a time: waiting writers sleep in coarse steps and give
        # up with "database is locked" after the busy timeout. Queue this process's own
        # writers here instead.
        self._serialize_writes = bind is not None and bind.dialect.name == "sqlite"
        self._bind: AsyncEngine | None = bind
        self._write_lock = asyncio.Lock()
        self._batcher = TurnBatcher(self.add_turns)
        self._placed: OrderedDict[uuid.UUID, turn_sql.Placement] = OrderedDict()
        self._added: asyncio.Event | None = None  # replaced each time trajectories appear

    def write_transaction(self) -> contextlib.AbstractAsyncContextManager[AsyncSession]:
        """A write transaction, queued like this repository's own (for the trajectory stream)."""
        return self._write()

    def trajectories_added(self) -> asyncio.Event:
        """An event set the next time this process creates trajectories."""
        if self._added is None:
            self._added = asyncio.Event()
        return self._added

    def _announce(self) -> None:
        if self._added is not None:
            self._added.set()
            self._added = None

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncSession]:
        """A write transaction (queued behind this process's other writers on SQLite)."""
        async with contextlib.AsyncExitStack() as stack:
            if self._serialize_writes:
                await stack.enter_async_context(self._write_lock)
            yield await stack.enter_async_context(self._sessions.begin())

    @contextlib.asynccontextmanager
    async def _turn_writer(
        self, *, transaction: bool = False
    ) -> AsyncIterator[AsyncSession | AsyncConnection]:
        """Where a batch of turns is written. On PostgreSQL: an autocommit connection, as
        the batch is one INSERT (atomic by itself, the episode checked by a trigger), which
        saves the round trips of BEGIN and COMMIT; a batch with images (blobs, turns,
        links: several statements) gets a transaction. SQLite has no round trips to save."""
        if transaction or self._serialize_writes or self._bind is None:
            async with self._write() as session:
                yield session
            return
        async with self._bind.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    # ---- episodes -------------------------------------------------------------------

    async def create_episode(
        self,
        *,
        run_id: uuid.UUID | None = None,
        environment_id: uuid.UUID | None = None,
        env_ref: str = "",
        task: Mapping[str, Any] | None = None,
        group_id: str | None = None,
        status: EpisodeStatus = "running",
        episode_id: uuid.UUID | None = None,
    ) -> uuid.UUID:
        if status not in OPEN_EPISODE_STATUSES:
            raise InvalidInput(
                f"a new episode is {' or '.join(sorted(OPEN_EPISODE_STATUSES))}", field="status"
            )
        _check_text("env_ref", env_ref, 200)
        _check_text("group_id", group_id, 64)
        try:
            json.dumps(task or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"task must be plain JSON: {exc}", field="task") from exc
        episode_id = episode_id or uuid.uuid4()
        row = {
            "id": episode_id,
            "run_id": run_id,
            "environment_id": environment_id,
            "env_ref": env_ref,
            "task": dict(task or {}),
            "group_id": group_id,
            "status": status,
            "created_at": datetime.now(UTC),
        }
        try:
            # One INSERT: the foreign keys check the run and env (explained below if not).
            async with self._turn_writer() as writer:
                await writer.execute(insert(_episodes), [row])
        except IntegrityError as exc:
            async with self._sessions() as session:
                for table, key in ((_runs, run_id), (_environments, environment_id)):
                    found = select(table.c.id).where(table.c.id == key)
                    if key is not None and await session.scalar(found) is None:
                        raise NotFound(f"{table.name[:-1]} {key} not found") from None
            raise Conflict(f"episode {episode_id} conflicts with stored data: {exc.orig}") from exc
        return episode_id

    async def episode(self, episode_id: uuid.UUID) -> EpisodeInfo:
        async with self._sessions() as session:
            row = (
                await session.execute(select(_episodes).where(_episodes.c.id == episode_id))
            ).one_or_none()
        if row is None:
            raise NotFound(f"episode {episode_id} not found")
        return turn_rows.episode_info(row)

    # ---- writing turns --------------------------------------------------------------

    async def add_turn(
        self,
        episode_id: uuid.UUID,
        parent_id: uuid.UUID | None,
        record: TurnRecord,
        *,
        turn_id: uuid.UUID | None = None,
    ) -> uuid.UUID:
        """Append `record` under `parent_id` (None: a new root); the new turn's id.

        Concurrent calls are committed together (see `agentflow.db.turn_batcher`); each
        still gets its own turn's error."""
        turn = NewTurn(
            episode_id=episode_id, parent_id=parent_id, record=record, id=turn_id or uuid.uuid4()
        )
        await self._batcher.add(turn)
        return turn.id

    def submit_turn(
        self, episode_id: uuid.UUID, parent_id: uuid.UUID | None, record: TurnRecord
    ) -> tuple[uuid.UUID, asyncio.Future[None]]:
        """Queue a turn without waiting for its commit: its id, and a future that resolves
        once it is committed. Turns submitted later (its children) are written after it,
        so a loop can go on while the database works and await the futures at the end."""
        turn = NewTurn(episode_id=episode_id, parent_id=parent_id, record=record)
        return turn.id, self._batcher.submit(turn)

    async def add_turns(self, batch: Sequence[NewTurn]) -> list[uuid.UUID]:
        """Write `batch` (any number of episodes and branches, parents before children)
        in one transaction; their ids in order."""
        if not batch:
            return []
        try:
            async with self._turn_writer(transaction=turn_images.has_images(batch)) as writer:
                written = await turn_sql.insert_turns(writer, batch, self._placed, self.blob_store)
        except IntegrityError as exc:
            raise await turn_sql.explain_insert_failure(self._sessions, batch, exc) from exc
        self._remember(written)
        return [turn.id for turn in batch]

    def _remember(self, written: Mapping[uuid.UUID, turn_sql.Placement]) -> None:
        """Keep where recent turns sit, so their children's writes need not read them."""
        self._placed.update(written)
        while len(self._placed) > _PLACED_LIMIT:
            self._placed.popitem(last=False)

    # ---- reading turns --------------------------------------------------------------

    async def contexts(self, turn_ids: Sequence[uuid.UUID]) -> list[Context]:
        """The full context of each turn, in the order asked."""
        unique = turn_rows.ids_in_order(turn_ids)
        async with self._sessions() as session:
            paths = await turn_sql.paths(session, unique, turn_sql.CONTEXT_COLUMNS)
        missing = [t for t in unique if t not in paths]
        if missing:
            raise NotFound(f"turn {missing[0]} not found")
        built = {t: turn_rows.context_from_path(paths[t]) for t in unique}
        return [built[t] for t in turn_ids]

    async def context(self, turn_id: uuid.UUID) -> Context:
        """Tokens, log-probs, loss mask and weight versions of everything root → `turn_id`."""
        return (await self.contexts([turn_id]))[0]

    async def path(self, turn_id: uuid.UUID) -> list[StoredTurn]:
        """The turns from the root down to `turn_id`, inclusive."""
        async with self._sessions() as session:
            paths = await turn_sql.paths(session, [turn_id], turn_sql.TURN_COLUMNS)
            if turn_id not in paths:
                raise NotFound(f"turn {turn_id} not found")
            images = await turn_images.images_of(session, [row.id for row in paths[turn_id]])
        return [turn_rows.stored_turn(row, images) for row in paths[turn_id]]

    async def turn(self, turn_id: uuid.UUID) -> StoredTurn:
        async with self._sessions() as session:
            row = (
                await session.execute(select(_turns).where(_turns.c.id == turn_id))
            ).one_or_none()
            if row is None:
                raise NotFound(f"turn {turn_id} not found")
            images = await turn_images.images_of(session, [turn_id])
        return turn_rows.stored_turn(row, images)

    async def children(self, turn_id: uuid.UUID) -> list[StoredTurn]:
        """The branches under `turn_id`, oldest first."""
        async with self._sessions() as session:
            if await session.scalar(select(_turns.c.id).where(_turns.c.id == turn_id)) is None:
                raise NotFound(f"turn {turn_id} not found")
            rows = await session.execute(
                select(_turns)
                .where(_turns.c.parent_id == turn_id)
                .order_by(_turns.c.created_at, _turns.c.id)
            )
            return await self._with_images(session, rows.all())

    async def leaves(self, episode_id: uuid.UUID) -> list[StoredTurn]:
        """The turns of an episode that have no children, shallowest and oldest first."""
        child = _turns.alias("child")
        async with self._sessions() as session:
            await self._require_episode(session, episode_id)
            rows = await session.execute(
                select(_turns)
                .where(_turns.c.episode_id == episode_id)
                .where(~exists().where(child.c.parent_id == _turns.c.id))
                .order_by(_turns.c.depth, _turns.c.created_at, _turns.c.id)
            )
            return await self._with_images(session, rows.all())

    async def episode_tree(self, episode_id: uuid.UUID) -> EpisodeTree:
        """The episode with its whole turn forest and its trajectories."""
        async with self._sessions() as session:
            episode = await self._require_episode(session, episode_id)
            turn_list = (
                await session.execute(
                    select(_turns)
                    .where(_turns.c.episode_id == episode_id)
                    .order_by(_turns.c.created_at, _turns.c.id)
                )
            ).all()
            trajectories = (
                await session.execute(
                    select(_trajectories)
                    .where(_trajectories.c.episode_id == episode_id)
                    .order_by(_trajectories.c.created_at, _trajectories.c.id)
                )
            ).all()
            images = await self._episode_images(session, episode_id)
        kids: dict[uuid.UUID | None, list[uuid.UUID]] = defaultdict(list)
        for row in turn_list:
            kids[row.parent_id].append(row.id)
        # Deepest first, so every child exists before its (frozen) parent is built.
        nodes: dict[uuid.UUID, TurnNode] = {}
        for row in sorted(turn_list, key=lambda r: -r.depth):
            flat = turn_rows.stored_turn(row, images)
            nodes[row.id] = TurnNode(
                **{f.name: getattr(flat, f.name) for f in fields(StoredTurn)},
                children=tuple(nodes[c] for c in kids[row.id]),
            )
        return EpisodeTree(
            **turn_rows.episode_fields(episode),
            roots=tuple(nodes[r] for r in kids[None]),
            trajectories=tuple(turn_rows.trajectory_ref(t) for t in trajectories),
        )

    async def _with_images(self, session: AsyncSession, rows: Sequence[Any]) -> list[StoredTurn]:
        images = await turn_images.images_of(session, [row.id for row in rows])
        return [turn_rows.stored_turn(row, images) for row in rows]

    async def _episode_images(
        self, session: AsyncSession, episode_id: uuid.UUID
    ) -> dict[uuid.UUID, tuple[str, ...]]:
        links = turn_images.turn_blobs
        rows = await session.execute(
            select(links.c.turn_id, links.c.sha256)
            .join(_turns, _turns.c.id == links.c.turn_id)
            .where(_turns.c.episode_id == episode_id)
            .order_by(links.c.turn_id, links.c.position)
        )
        found: dict[uuid.UUID, tuple[str, ...]] = {}
        for row in rows:
            found[row.turn_id] = (*found.get(row.turn_id, ()), row.sha256)
        return found

    # ---- blobs ----------------------------------------------------------------------

    async def images_of(self, turn_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, ...]]:
        """The blob ids of each of `turn_ids` that has images, in order."""
        async with self._sessions() as session:
            return await turn_images.images_of(session, turn_ids)

    async def blob(self, sha256: str) -> tuple[BlobInfo, bytes]:
        """A stored blob's media type, size and bytes; `NotFound` when unknown."""
        async with self._sessions() as session:
            found = await blobs.info(session, sha256)
            data = None if found is None else await self.blob_store.get(sha256, session)
        if found is None or data is None:
            raise NotFound(f"blob {sha256} not found")
        return found, data

    async def _require_episode(self, session: AsyncSession, episode_id: uuid.UUID) -> Any:
        row = (
            await session.execute(select(_episodes).where(_episodes.c.id == episode_id))
        ).one_or_none()
        if row is None:
            raise NotFound(f"episode {episode_id} not found")
        return row

    # ---- completion and trajectories ------------------------------------------------

    async def complete_episode(
        self,
        episode_id: uuid.UUID,
        status: EpisodeStatus,
        reward: float | None = None,
        *,
        leaf_turn_ids: Sequence[uuid.UUID] | None = None,
        leaf_rewards: Mapping[uuid.UUID, float] | None = None,
        error: str | None = None,
        turns: Sequence[NewTurn] = (),
    ) -> list[uuid.UUID]:
        """Finish an episode and create its trajectories, atomically and only once.

        `turns` (e.g. the final env turn) are written in the same transaction. A
        `completed` or `truncated` episode gets one `ready` trajectory per turn in
        `leaf_turn_ids` (default: every leaf), rewarded `leaf_rewards[leaf]` or else
        `reward`; `failed` and `aborted` episodes get none. Returns the trajectory ids.
        Raises `Conflict` if the episode is already finished.
        """
        if status not in FINAL_EPISODE_STATUSES:
            raise InvalidInput(
                f"status must be one of {sorted(FINAL_EPISODE_STATUSES)}", field="status"
            )
        rewards = dict(leaf_rewards or {})
        for value in (reward, *rewards.values()):
            if value is not None and not math.isfinite(value):
                raise InvalidInput("rewards must be finite", field="reward")
        if status not in TRAINABLE_EPISODE_STATUSES and (leaf_turn_ids or rewards):
            raise InvalidInput(f"a {status} episode has no trajectories", field="leaf_turn_ids")
        _check_text("error", error, None)
        if any(t.episode_id != episode_id for t in turns):
            raise InvalidInput("final turns must belong to the episode", field="turns")
        if leaf_turn_ids is not None and len(set(leaf_turn_ids)) != len(leaf_turn_ids):
            raise InvalidInput("leaf_turn_ids has repeats", field="leaf_turn_ids")

        try:
            async with self._write() as session:
                if turns:
                    await turn_sql.insert_turns(session, turns, blob_store=self.blob_store)
                now = datetime.now(UTC)
                # The status guard makes this UPDATE the claim: a second completion matches
                # no row (on PostgreSQL it waits for the first and then re-reads the row).
                claimed = (
                    await session.execute(
                        update(_episodes)
                        .where(_episodes.c.id == episode_id)
                        .where(_episodes.c.status.in_(OPEN_EPISODE_STATUSES))
                        .values(status=status, reward=reward, error=error, finished_at=now)
                        .returning(_episodes.c.run_id)
                    )
                ).one_or_none()
                if claimed is None:
                    episode = await self._require_episode(session, episode_id)
                    raise Conflict(f"episode {episode_id} is already {episode.status}")
                tree = (
                    await session.execute(
                        select(_turns.c.id, _turns.c.parent_id, _turns.c.weight_versions)
                        .where(_turns.c.episode_id == episode_id)
                        .order_by(_turns.c.depth, _turns.c.created_at, _turns.c.id)
                    )
                ).all()
                versions = turn_rows.version_range(row.weight_versions for row in tree)
                if versions is not None:
                    await session.execute(
                        update(_episodes)
                        .where(_episodes.c.id == episode_id)
                        .values(min_weight_version=versions[0], max_weight_version=versions[1])
                    )
                if status not in TRAINABLE_EPISODE_STATUSES:
                    return []
                rows = turn_rows.trajectory_rows(
                    tree,
                    episode_id=episode_id,
                    run_id=claimed.run_id,
                    leaf_turn_ids=leaf_turn_ids,
                    leaf_rewards=rewards,
                    reward=reward,
                    created_at=now,
                )
                if rows:  # an empty parameter list would insert one row of defaults
                    await session.execute(insert(_trajectories), rows)
        except IntegrityError as exc:
            raise await turn_sql.explain_insert_failure(self._sessions, turns, exc) from exc
        if rows:
            self._announce()
        return [row["id"] for row in rows]

    async def trajectories(self, trajectory_ids: Sequence[uuid.UUID]) -> list[TrajectoryView]:
        """Trajectories with their full tokens, in the order asked."""
        unique = turn_rows.ids_in_order(trajectory_ids)
        found: dict[uuid.UUID, Any] = {}
        async with self._sessions() as session:
            for chunk in turn_sql.chunks(unique):
                rows = await session.execute(
                    select(_trajectories, _episodes.c.group_id, _episodes.c.env_ref)
                    .join(_episodes, _episodes.c.id == _trajectories.c.episode_id)
                    .where(_trajectories.c.id.in_(chunk))
                )
                found.update({row.id: row for row in rows})
            missing = [t for t in unique if t not in found]
            if missing:
                raise NotFound(f"trajectory {missing[0]} not found")
            leaves = turn_rows.ids_in_order([found[t].leaf_turn_id for t in unique])
            paths = await turn_sql.paths(session, leaves, turn_sql.TRAJECTORY_COLUMNS)
        built: dict[uuid.UUID, TrajectoryView] = {}
        for tid in unique:
            row = found[tid]
            context = turn_rows.context_from_path(paths[row.leaf_turn_id])
            built[tid] = TrajectoryView(
                id=row.id,
                run_id=row.run_id,
                episode_id=row.episode_id,
                group_id=row.group_id,
                leaf_turn_id=row.leaf_turn_id,
                reward=row.reward,
                status=row.status,
                times_served=row.times_served,
                min_weight_version=row.min_weight_version,
                created_at=turn_rows.aware(row.created_at),
                lease_id=row.lease_id,
                env_ref=row.env_ref or "",
                turn_rewards=tuple(float(t.reward or 0.0) for t in paths[row.leaf_turn_id]),
                **{f.name: getattr(context, f.name) for f in fields(Context)},
            )
        return [built[t] for t in trajectory_ids]

    async def trajectory(self, trajectory_id: uuid.UUID) -> TrajectoryView:
        """One trajectory with its token ids, log-probs, loss mask, versions and reward."""
        return (await self.trajectories([trajectory_id]))[0]
