"""`TurnTree`: the repository of episodes, their turn trees and their trajectories.

A turn appends a segment of tokens to its parent's context; the context of any turn is
rebuilt in one query (a recursive CTE walking parent links, which both PostgreSQL and
SQLite run); a lease's many trajectories read their episodes' turns by the episode index
instead and link each path in Python (`turn_sql.episode_paths`). Rollouts write
thousands of turns and hundreds of episodes a second, so writes are group commits
(`agentflow.db.group_commit`): concurrent turns, episode creates and episode ends each
share one batch, written with one executemany per statement, never the ORM unit of work;
on PostgreSQL the batches go straight to asyncpg's prepared statements (`turn_sql`,
`episode_sql`), elsewhere through SQLAlchemy Core.

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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from agentflow import ids
from agentflow.db import blobs, direct, episode_sql, id_lists, turn_images, turn_rows, turn_sql
from agentflow.db.blobs import BlobInfo, BlobStore, DatabaseBlobStore
from agentflow.db.group_commit import GroupCommit
from agentflow.db.models import Environment, Run
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
# A lease reads its trajectories' rows (with their group and env) by id: built once.
_TRAJECTORY_ROWS = id_lists.both(
    lambda array: (
        select(_trajectories, _episodes.c.group_id, _episodes.c.env_ref)
        .join(_episodes, _episodes.c.id == _trajectories.c.episode_id)
        .where(id_lists.id_match(_trajectories.c.id, "ids", array=array))
    )
)


def _check_text(name: str, value: str | None, max_length: int | None) -> None:
    if value is None:
        return
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(f"{name} is longer than {max_length} characters", field=name)
    if "\x00" in value:  # PostgreSQL text cannot hold NUL; refuse it on SQLite too
        raise InvalidInput(f"{name} must not contain NUL characters", field=name)


# Recent turns this process wrote, kept in memory as written (`turn_rows.WrittenTurn`):
# their children's writes need not read where they sit, and a lease builds the paths of
# trajectories whose every turn is kept without reading them back. A lease forgets what
# it served; the oldest go first past this many (about 1 KiB each for a turn of 50
# tokens, so at most about 100 MiB).
_KEPT_LIMIT = 100_000
# How long a group commit keeps its connection after its last write: longer than the
# gaps between an episode's writes, short next to anything a person waits for.
_LINGER_S = 0.05
# How long a write nobody waits on at once may wait for others to share its batch
# (`GroupCommit.submit(gather=True)`): a white-box episode's turns. Far below an
# episode's length, and it saves a statement per write that would otherwise go alone.
# A run executor's episode creates and ends gather too (`gather=True`); an API call's
# do not, someone waits on them. 50 ms rather than 20: at 1,000 episodes the batches of
# creates and ends are then about ten, not four, and the controller's CPU per turn fell
# by a tenth to a fifth (docs/performance.md), for up to 30 ms more at an episode's start
# and end.
_GATHER_S = 0.05


class _WriteAlone(Exception):
    """A group commit's batch must be written again one item at a time."""


@dataclass(frozen=True, slots=True)
class _EpisodeEnd:
    """A validated `complete_episode` call, waiting for its group commit."""

    episode_id: uuid.UUID
    status: EpisodeStatus
    reward: float | None
    leaf_turn_ids: Sequence[uuid.UUID] | None
    leaf_rewards: Mapping[uuid.UUID, float]
    error: str | None
    turns: Sequence[NewTurn]


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
        self._write_lock = asyncio.Lock()
        # Group commits: concurrent single writes share one batch (agentflow.db.group_commit).
        # On PostgreSQL through asyncpg their statements go straight to the driver, each on
        # a connection it keeps while its writes keep coming (`agentflow.db.direct`).
        direct_to = bind if bind is not None and bind.dialect.driver == "asyncpg" else None
        self._turn_conn = self._held(direct_to)
        self._create_conn = self._held(direct_to)
        self._end_conn = self._held(direct_to)
        self._turn_writes: GroupCommit[NewTurn, None] = self._group_commit(
            self._write_turns, self._turn_conn
        )
        self._episode_creates: GroupCommit[dict[str, Any], None] = self._group_commit(
            self._create_episodes, self._create_conn
        )
        self._episode_ends: GroupCommit[_EpisodeEnd, list[uuid.UUID]] = self._group_commit(
            self._end_episodes, self._end_conn
        )
        self._kept: OrderedDict[uuid.UUID, turn_rows.WrittenTurn] = OrderedDict()
        self._added: asyncio.Event | None = None  # replaced each time trajectories appear
        # Trajectories this process has made, ever: a pull that needs `n` more waits for
        # this to grow by `n` before it looks again (others' are seen only by looking).
        self.trajectories_made = 0

    @staticmethod
    def _held(engine: AsyncEngine | None) -> direct.HeldConnection | None:
        return None if engine is None else direct.HeldConnection(engine)

    @staticmethod
    def _group_commit(
        write_batch: Any, held: direct.HeldConnection | None
    ) -> GroupCommit[Any, Any]:
        if held is None:
            return GroupCommit(write_batch, gather_s=_GATHER_S)
        return GroupCommit(
            write_batch, linger_s=_LINGER_S, gather_s=_GATHER_S, on_idle=held.release
        )

    def write_transaction(self) -> contextlib.AbstractAsyncContextManager[AsyncSession]:
        """A write transaction, queued like this repository's own (for the trajectory stream)."""
        return self._write()

    def trajectories_added(self) -> asyncio.Event:
        """An event set the next time this process creates trajectories."""
        if self._added is None:
            self._added = asyncio.Event()
        return self._added

    def _announce(self, made: int) -> None:
        self.trajectories_made += made
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
        gather: bool = False,
    ) -> uuid.UUID:
        """A new episode's id, once its row is committed. `gather`: the write may wait a
        moment for others to share its batch (a run's executor; not an API call)."""
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
        episode_id = episode_id or ids.new_id()
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
        await self._episode_creates.add(row, gather=gather)
        return episode_id

    async def _create_episodes(self, rows: Sequence[dict[str, Any]]) -> list[None]:
        """One INSERT for a group commit's new episodes; the foreign keys check the runs
        and envs (a lone episode's failure explained; a batch's is retried one by one)."""
        try:
            async with self._episode_statements(self._create_conn) as statements:
                await statements.insert_episodes(rows)
        except IntegrityError as exc:
            if len(rows) > 1:
                raise
            row = rows[0]
            async with self._sessions() as session:
                for table, key in ((_runs, row["run_id"]), (_environments, row["environment_id"])):
                    found = select(table.c.id).where(table.c.id == key)
                    if key is not None and await session.scalar(found) is None:
                        raise NotFound(f"{table.name[:-1]} {key} not found") from None
            raise Conflict(f"episode {row['id']} conflicts with stored data: {exc.orig}") from exc
        return [None] * len(rows)

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

        Concurrent calls are committed together (see `agentflow.db.group_commit`); each
        still gets its own turn's error."""
        turn = NewTurn(
            episode_id=episode_id, parent_id=parent_id, record=record, id=turn_id or ids.new_id()
        )
        await self._turn_writes.add(turn)
        return turn.id

    def submit_turn(
        self, episode_id: uuid.UUID, parent_id: uuid.UUID | None, record: TurnRecord
    ) -> tuple[uuid.UUID, asyncio.Future[None]]:
        """Queue a turn without waiting for its commit: its id, and a future that resolves
        once it is committed. Turns submitted later (its children) are written after it,
        so a loop can go on while the database works and await the futures at the end."""
        turn = NewTurn(episode_id=episode_id, parent_id=parent_id, record=record)
        return turn.id, self._turn_writes.submit(turn, gather=True)

    def hurry_turns(self, *, at_most: int | None = None) -> None:
        """Write the queued turns now: their submitter waits on them (`submit_turn`'s
        writes may otherwise wait a moment for others to share their batch). With
        `at_most`, only if no more than that many are queued."""
        if at_most is None or self._turn_writes.queued <= at_most:
            self._turn_writes.hurry()

    async def _write_turns(self, batch: Sequence[NewTurn]) -> list[None]:
        await self._add_turns(batch, self._turn_conn)
        return [None] * len(batch)

    @property
    def write_waits(self) -> dict[str, list[int]]:
        """How long writes waited for their group commit, by kind: histogram counts over
        `group_commit.WAIT_EDGES_S` so far (subtract two to get a window)."""
        return {
            "turns": self._turn_writes.waits.snapshot(),
            "episode_creates": self._episode_creates.waits.snapshot(),
            "episode_ends": self._episode_ends.waits.snapshot(),
        }

    @property
    def turns_queued(self) -> int:
        """Turn writes waiting for a batch (the one being written not counted)."""
        return self._turn_writes.queued

    @property
    def queued_writes(self) -> dict[str, int]:
        """Writes waiting for their group commit, by kind (the batches under way not counted)."""
        return {
            "turns": self._turn_writes.queued,
            "episode_creates": self._episode_creates.queued,
            "episode_ends": self._episode_ends.queued,
        }

    async def add_turns(self, batch: Sequence[NewTurn]) -> list[uuid.UUID]:
        """Write `batch` (any number of episodes and branches, parents before children)
        in one transaction; their ids in order."""
        one_off = None
        if self._turn_conn is not None:
            one_off = direct.HeldConnection(self._turn_conn.engine, keep=False)
        return await self._add_turns(batch, one_off)

    async def _add_turns(
        self, batch: Sequence[NewTurn], direct_conn: direct.HeldConnection | None
    ) -> list[uuid.UUID]:
        """`add_turns`, straight on asyncpg on `direct_conn` where there is one."""
        if not batch:
            return []
        try:
            if direct_conn is not None and not turn_images.has_images(batch):
                # One INSERT, atomic by itself (the episode checked by a trigger): no
                # transaction, so no round trips for BEGIN and COMMIT.
                async with direct_conn.driver() as driver:
                    written = await turn_sql.insert_turns_direct(driver, batch, self._kept)
            else:  # SQLite, or images: blobs, turns and links in one transaction
                async with self._write() as session:
                    written = await turn_sql.insert_turns(
                        session, batch, self._kept, self.blob_store
                    )
        except IntegrityError as exc:
            raise await turn_sql.explain_insert_failure(self._sessions, batch, exc) from exc
        self._remember(written)
        return [turn.id for turn in batch]

    def _remember(self, written: Sequence[turn_rows.WrittenTurn]) -> None:
        """Keep recent turns as written (`_KEPT_LIMIT`), once they are committed."""
        kept = self._kept
        for turn in written:
            kept[turn.id] = turn
        while len(kept) > _KEPT_LIMIT:
            kept.popitem(last=False)

    def _kept_path(self, leaf: uuid.UUID) -> list[turn_rows.WrittenTurn] | None:
        """The root-first path to `leaf` when every turn of it is kept, else None."""
        kept = self._kept
        path = []
        turn = kept.get(leaf)
        while turn is not None:
            path.append(turn)
            if turn.parent_id is None:
                path.reverse()
                return path
            turn = kept.get(turn.parent_id)
        return None

    def _forget(self, turn_ids: Iterable[uuid.UUID]) -> None:
        kept = self._kept
        for turn_id in turn_ids:
            kept.pop(turn_id, None)

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
        gather: bool = False,
    ) -> list[uuid.UUID]:
        """Finish an episode and create its trajectories, atomically and only once.

        `turns` (e.g. the final env turn) are written in the same transaction. A
        `completed` or `truncated` episode gets one `ready` trajectory per turn in
        `leaf_turn_ids` (default: every leaf), rewarded `leaf_rewards[leaf]` or else
        `reward`; `failed` and `aborted` episodes get none. Returns the trajectory ids.
        Raises `Conflict` if the episode is already finished. `gather`: the write may
        wait a moment for other ends to share its transaction (a run's executor).
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

        return await self._episode_ends.add(
            _EpisodeEnd(episode_id, status, reward, leaf_turn_ids, rewards, error, turns),
            gather=gather,
        )

    @contextlib.asynccontextmanager
    async def _episode_statements(
        self, held: direct.HeldConnection | None, *, transaction: bool = False
    ) -> AsyncIterator[episode_sql.EpisodeStatements]:
        """Where a group commit's episode statements run (`agentflow.db.episode_sql`):
        straight on asyncpg for PostgreSQL, on the group commit's `held` connection (in
        one transaction of its own when asked), else SQLAlchemy Core (queued behind this
        process's writers on SQLite)."""
        if held is not None:
            async with held.driver() as driver:
                if transaction:
                    async with driver.transaction():
                        yield episode_sql.AsyncpgStatements(driver)
                else:
                    yield episode_sql.AsyncpgStatements(driver)
            return
        async with self._write() as session:
            yield episode_sql.AlchemyStatements(await session.connection())

    async def _end_episodes(self, ends: Sequence[_EpisodeEnd]) -> list[list[uuid.UUID] | Exception]:
        """A group commit's episode ends in one transaction: their final turns, a lock on
        their rows (in id order, so concurrent commits never deadlock), their turns read
        in one query, one executemany setting each end, one INSERT of the trajectories.
        An episode already finished (or missing, or whose leaves are not its own) fails
        alone; the others are written."""
        final = [t for end in ends for t in end.turns]
        try:
            if final:  # the final turns' tree checks and images are SQLAlchemy's
                async with self._write() as session:
                    await turn_sql.insert_turns(session, final, blob_store=self.blob_store)
                    alchemy = episode_sql.AlchemyStatements(await session.connection())
                    results, made = await self._write_ends(alchemy, ends)
            else:
                async with self._episode_statements(self._end_conn, transaction=True) as statements:
                    results, made = await self._write_ends(statements, ends)
        except IntegrityError as exc:
            if len(ends) > 1:
                raise  # written again one by one, each with its own explanation
            raise await turn_sql.explain_insert_failure(self._sessions, final, exc) from exc
        if made:
            self._announce(made)
        return results

    async def _write_ends(
        self, statements: episode_sql.EpisodeStatements, ends: Sequence[_EpisodeEnd]
    ) -> tuple[list[list[uuid.UUID] | Exception], int]:
        """`_end_episodes` inside its transaction: each end's result, and how many
        trajectories were made."""
        results: list[list[uuid.UUID] | Exception] = [[] for _ in ends]
        ids = sorted({end.episode_id for end in ends})
        found: dict[uuid.UUID, episode_sql.LockedEpisode] = {}
        for chunk in turn_sql.chunks(ids):
            # The lock is the claim: a turn inserted meanwhile waits for this commit, then
            # finds its episode finished (trigger), so the tree read next is whole.
            found.update({row.id: row for row in await statements.lock_episodes(chunk)})
        open_ids = [i for i, row in found.items() if row.status in OPEN_EPISODE_STATUSES]
        trees: dict[uuid.UUID, list[episode_sql.TreeTurn]] = defaultdict(list)
        for chunk in turn_sql.chunks(open_ids):
            for turn in await statements.episode_turns(chunk):
                trees[turn.episode_id].append(turn)
        now = datetime.now(UTC)
        status_now = {i: row.status for i, row in found.items()}
        updates: list[dict[str, Any]] = []
        made: list[dict[str, Any]] = []
        for index, end in enumerate(ends):
            status = status_now.get(end.episode_id)
            if status is None:
                results[index] = NotFound(f"episode {end.episode_id} not found")
                continue
            if status not in OPEN_EPISODE_STATUSES:
                results[index] = Conflict(f"episode {end.episode_id} is already {status}")
                continue
            tree = trees[end.episode_id]
            rows: list[dict[str, Any]] = []
            if end.status not in TRAINABLE_EPISODE_STATUSES:  # no lease will read its turns
                self._forget(turn.id for turn in tree)
            else:
                try:
                    rows = turn_rows.trajectory_rows(
                        tree,
                        episode_id=end.episode_id,
                        run_id=found[end.episode_id].run_id,
                        leaf_turn_ids=end.leaf_turn_ids,
                        leaf_rewards=end.leaf_rewards,
                        reward=end.reward,
                        created_at=now,
                    )
                except InvalidInput as exc:
                    results[index] = exc
                    continue
            versions = turn_rows.version_range(turn.weight_versions for turn in tree)
            status_now[end.episode_id] = end.status
            updates.append(
                {
                    "id": end.episode_id,
                    "status": end.status,
                    "reward": end.reward,
                    "error": end.error,
                    "finished_at": now,
                    "min_weight_version": None if versions is None else versions[0],
                    "max_weight_version": None if versions is None else versions[1],
                }
            )
            made.extend(rows)
            results[index] = [row["id"] for row in rows]
        undone = [
            result
            for end, result in zip(ends, results, strict=True)
            if end.turns and isinstance(result, Exception)
        ]
        if undone:  # a failed end writes none of its final turns: roll them back
            raise undone[0] if len(ends) == 1 else _WriteAlone()
        if updates:
            await statements.end_episodes(updates)
        if made:  # an empty parameter list would insert one row of defaults
            await statements.insert_trajectories(made)
        return results, len(made)

    async def trajectories(self, trajectory_ids: Sequence[uuid.UUID]) -> list[TrajectoryView]:
        """Trajectories with their full tokens, in the order asked. Paths whose turns this
        process wrote and still keeps are built from memory, and then forgotten (a
        trajectory is read when a lease serves it, mostly once); the rest are read."""
        unique = turn_rows.ids_in_order(trajectory_ids)
        found: dict[uuid.UUID, Any] = {}
        async with self._sessions() as session:
            conn = await session.connection()  # Core, not the ORM: a lease reads these
            for chunk in turn_sql.chunks(unique):
                rows = await conn.execute(_TRAJECTORY_ROWS.on(conn), {"ids": list(chunk)})
                found.update({row.id: row for row in rows})
            missing = [t for t in unique if t not in found]
            if missing:
                raise NotFound(f"trajectory {missing[0]} not found")
            kept: dict[uuid.UUID, list[turn_rows.WrittenTurn]] = {}
            unkept: dict[uuid.UUID, uuid.UUID] = {}
            for tid in unique:
                leaf = found[tid].leaf_turn_id
                path = self._kept_path(leaf)
                if path is None:
                    unkept[leaf] = found[tid].episode_id
                else:
                    kept[leaf] = path
            paths: dict[uuid.UUID, Sequence[Any]] = dict(kept)
            if unkept:
                paths.update(
                    await turn_sql.episode_paths(session, unkept, turn_sql.TRAJECTORY_COLUMNS)
                )
        built: dict[uuid.UUID, TrajectoryView] = {}
        for tid in unique:
            row = found[tid]
            if row.leaf_turn_id not in paths:  # the schema's foreign key rules it out
                raise NotFound(f"leaf turn {row.leaf_turn_id} of trajectory {tid} not found")
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
        self._forget(turn.id for path in kept.values() for turn in path)
        return [built[t] for t in trajectory_ids]

    async def trajectory(self, trajectory_id: uuid.UUID) -> TrajectoryView:
        """One trajectory with its token ids, log-probs, loss mask, versions and reward."""
        return (await self.trajectories([trajectory_id]))[0]
