"""`RunStore`: the one home of a run's stored state (docs/architecture.md, "Data model").

Creating a run (and linking the registered envs it plays), its status, its weight
versions and their metrics, what a restart restores (the version and the groups already
admitted and trained), and crash recovery (no episode stays live after a restart). The
scheduler, the run manager, the embedded trainer and the REST routes all go through it,
so a run's rows change in one way only.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import String, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.db.models import (
    Episode,
    Run,
    RunEnvironment,
    RunEnvRevision,
    Trajectory,
    WeightVersion,
)
from agentflow.errors import Conflict, NotFound
from agentflow.types import OPEN_EPISODE_STATUSES

LIVE_RUN_STATUSES = ("running", "paused")
ENDED_RUN_STATUSES = ("stopped", "finished", "failed")
CREATED_BY = "created"  # who made a run's first mix: whoever created the run
# The uri of a version a trainer handed over as tensors in its own process: its weights
# are nowhere on disk, so only that trainer (from its checkpoint) can bring them back.
IN_PROCESS_URI = "inprocess"


@dataclass(frozen=True)
class RestorePoint:
    """Where a restarted run's scheduler resumes: the trainer's version, the groups that
    have made trajectories, and how many of those the trainer has leased."""

    version: int
    groups_admitted: int
    groups_taken: int


@dataclass(frozen=True)
class PublishedWeights:
    """A weight version and where it was published: a directory for `disk` sync, or
    `IN_PROCESS_URI` when the trainer handed the tensors over in its own process."""

    version: int
    uri: str


@dataclass(frozen=True)
class StoredRun:
    id: uuid.UUID
    name: str
    status: str
    config: dict[str, Any]
    weight_version: int
    env_revision: int = 0


@dataclass(frozen=True)
class EnvRevision:
    """One revision of a run's env mix: `envs` (the config's entries) in effect from
    `created_at`, when the run served `weight_version`."""

    revision: int
    envs: list[dict[str, Any]]
    weight_version: int
    changed_by: str
    created_at: datetime


class RunStore:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def create(
        self, name: str, config: dict[str, Any], environment_ids: Iterable[uuid.UUID] = ()
    ) -> uuid.UUID:
        """A new pending run, linked to the registered envs it plays."""
        async with self.sessions.begin() as session:
            run = Run(name=name, config=config, status="pending", env_revision=0)
            session.add(run)
            await session.flush()
            session.add_all(
                RunEnvironment(run_id=run.id, environment_id=e) for e in set(environment_ids)
            )
            session.add(_first_revision(run))
            return run.id

    async def get(self, run_id: uuid.UUID) -> StoredRun:
        async with self.sessions() as session:
            run = await session.get(Run, run_id)
            if run is None:
                raise NotFound(f"run {run_id} not found")
            return _stored(run)

    async def latest(self, name: str) -> StoredRun | None:
        """The newest run of this name, if any."""
        async with self.sessions() as session:
            run = await session.scalar(
                select(Run).where(Run.name == name).order_by(Run.created_at.desc()).limit(1)
            )
            return None if run is None else _stored(run)

    async def set_status(self, run_id: uuid.UUID, status: str, *, error: str | None = None) -> None:
        async with self.sessions.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(status=status, error=error, updated_at=_now())
            )

    async def fail(self, run_id: uuid.UUID, error: str) -> None:
        await self.set_status(run_id, "failed", error=error)

    # ---- the env mix ----------------------------------------------------------------

    async def env_revisions(self, run_id: uuid.UUID) -> list[EnvRevision]:
        """The run's env mix revisions, oldest first (the last is in effect)."""
        async with self.sessions() as session:
            run = await session.get(Run, run_id)
            if run is None:
                raise NotFound(f"run {run_id} not found")
            return await read_env_revisions(session, run)

    async def revise_envs(
        self,
        run_id: uuid.UUID,
        *,
        seen: int,
        config: dict[str, Any],
        weight_version: int,
        changed_by: str,
        environment_ids: Iterable[uuid.UUID] = (),
    ) -> EnvRevision:
        """Store `config` (its `envs` changed) as revision `seen + 1` of the run's mix, in
        one transaction, where the run still holds revision `seen` and has not ended:
        of two changes made against the same revision one is stored, the other refused
        (`Conflict`), so no mix is ever one that neither asked for. Links the registered
        envs the new mix plays."""
        now = _now()
        async with self.sessions.begin() as session:
            run = await session.get(Run, run_id, with_for_update=True)
            if run is None:
                raise NotFound(f"run {run_id} not found")
            if run.status in ENDED_RUN_STATUSES:
                raise Conflict(f"run {run_id} is {run.status}: its env mix cannot change")
            if run.env_revision != seen:
                raise Conflict(
                    f"run {run_id}'s env mix is at revision {run.env_revision}, not {seen}: "
                    "read it again and send the change against that revision"
                )
            if seen == 0 and await session.get(RunEnvRevision, (run_id, 0)) is None:
                session.add(_first_revision(run))  # a run created before revisions were kept
            changed = await session.execute(
                update(Run)
                .where(Run.id == run_id, Run.env_revision == seen)
                .values(config=config, env_revision=seen + 1, updated_at=now)
            )
            if getattr(changed, "rowcount", 1) != 1:  # another writer got there first
                raise Conflict(f"run {run_id}'s env mix changed meanwhile: read it again")
            revision = RunEnvRevision(
                run_id=run_id,
                revision=seen + 1,
                envs=list(config["envs"]),
                weight_version=weight_version,
                changed_by=changed_by,
                created_at=now,
            )
            session.add(revision)
            linked = set(
                await session.scalars(
                    select(RunEnvironment.environment_id).where(RunEnvironment.run_id == run_id)
                )
            )
            session.add_all(
                RunEnvironment(run_id=run_id, environment_id=e)
                for e in set(environment_ids) - linked
            )
        return EnvRevision(seen + 1, list(config["envs"]), weight_version, changed_by, now)

    # ---- weight versions ------------------------------------------------------------

    async def record_version(
        self, run_id: uuid.UUID, version: int, uri: str, metrics: dict[str, Any]
    ) -> None:
        """The run's engines now serve `version` (published at `uri`)."""
        async with self.sessions.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(weight_version=version, updated_at=_now())
            )
            await session.execute(
                insert(WeightVersion).values(
                    run_id=run_id, version=version, uri=uri, metrics=metrics, created_at=_now()
                )
            )

    async def record_metrics(
        self, run_id: uuid.UUID, version: int, metrics: dict[str, Any], step: int | None = None
    ) -> None:
        """Attach a trainer step's metrics to the weight version it produced.

        With `step`, the metrics of that step or any later one held by an older version
        are cleared in the same transaction: they come from a trainer that was killed
        before it checkpointed those steps, and its successor does them again from its
        checkpoint, at newer versions. So each step has one row, however often it is
        recorded, and a repeat of the same call changes nothing. Only older versions:
        a late copy of an earlier call (a retried request the gateway also ran) must not
        clear the steps recorded after it."""
        async with self.sessions.begin() as session:
            if step is not None:
                await session.execute(
                    update(WeightVersion)
                    .where(WeightVersion.run_id == run_id)
                    .where(WeightVersion.version < version)
                    .where(WeightVersion.step >= step)
                    .values(metrics={}, step=None)
                )
            await session.execute(
                update(WeightVersion)
                .where(WeightVersion.run_id == run_id)
                .where(WeightVersion.version == version)
                .values(metrics=metrics, step=step)
            )

    async def versions(self, run_id: uuid.UUID) -> list[WeightVersion]:
        """The run's weight versions, oldest first."""
        async with self.sessions() as session:
            rows = await session.scalars(
                select(WeightVersion)
                .where(WeightVersion.run_id == run_id)
                .order_by(WeightVersion.version)
            )
            return list(rows)

    async def newest_weights(self, run_id: uuid.UUID) -> PublishedWeights | None:
        """The newest version the run's engines served and where it was published; None
        while the run still serves its initial weights."""
        async with self.sessions() as session:
            row = (
                await session.execute(
                    select(WeightVersion.version, WeightVersion.uri)
                    .where(WeightVersion.run_id == run_id)
                    .order_by(WeightVersion.version.desc())
                    .limit(1)
                )
            ).first()
        return None if row is None else PublishedWeights(int(row[0]), str(row[1]))

    # ---- restarts -------------------------------------------------------------------

    async def restore_point(self, run_id: uuid.UUID) -> RestorePoint:
        group = func.coalesce(Episode.group_id, func.cast(Episode.id, String))
        groups = (
            select(func.count(func.distinct(group)))
            .select_from(Trajectory)
            .join(Episode, Episode.id == Trajectory.episode_id)
            .where(Trajectory.run_id == run_id)
        )
        async with self.sessions() as session:
            version = await session.scalar(select(Run.weight_version).where(Run.id == run_id))
            admitted = await session.scalar(
                groups.where(Trajectory.status.in_(("ready", "leased", "consumed")))
            )
            taken = await session.scalar(
                groups.where(Trajectory.lease_id.is_not(None) | (Trajectory.times_served > 0))
            )
        return RestorePoint(version or 0, admitted or 0, taken or 0)

    async def recover(self, reason: str) -> tuple[int, list[StoredRun]]:
        """After a crash: every live episode is aborted with `reason`; returns how many,
        and the runs that were live (to start again)."""
        async with self.sessions.begin() as session:
            result = await session.execute(
                update(Episode)
                .where(Episode.status.in_(OPEN_EPISODE_STATUSES))
                .values(status="aborted", error=reason, finished_at=_now())
            )
            aborted = int(getattr(result, "rowcount", 0) or 0)
            runs = await session.scalars(select(Run).where(Run.status.in_(LIVE_RUN_STATUSES)))
            return aborted, [_stored(run) for run in runs]

    async def abort_groups(
        self, run_id: uuid.UUID, group_ids: Iterable[str], reason: str
    ) -> tuple[int, dict[str, int]]:
        """A controller shard died: its groups' live episodes are aborted with `reason`,
        as a restart aborts them. Returns how many, and each group's trajectories (a
        group missing from the map made none)."""
        groups = list(group_ids)
        if not groups:
            return 0, {}
        async with self.sessions.begin() as session:
            result = await session.execute(
                update(Episode)
                .where(
                    Episode.run_id == run_id,
                    Episode.group_id.in_(groups),
                    Episode.status.in_(OPEN_EPISODE_STATUSES),
                )
                .values(status="aborted", error=reason, finished_at=_now())
            )
            aborted = int(getattr(result, "rowcount", 0) or 0)
            made = await session.execute(
                select(Episode.group_id, func.count(Trajectory.id))
                .join(Trajectory, Trajectory.episode_id == Episode.id)
                .where(Episode.run_id == run_id, Episode.group_id.in_(groups))
                .group_by(Episode.group_id)
            )
            return aborted, {str(group): int(n) for group, n in made.all()}

    async def trajectory_count(self, episode_id: uuid.UUID) -> int:
        async with self.sessions() as session:
            count = await session.scalar(
                select(func.count())
                .select_from(Trajectory)
                .where(Trajectory.episode_id == episode_id)
            )
        return int(count or 0)


async def read_env_revisions(session: AsyncSession, run: Run) -> list[EnvRevision]:
    """`run`'s env mix revisions, oldest first, read on `session` (a request's own: a
    second session per request would hold two pooled connections at once)."""
    rows = list(
        await session.scalars(
            select(RunEnvRevision)
            .where(RunEnvRevision.run_id == run.id)
            .order_by(RunEnvRevision.revision)
        )
    )
    if not rows:  # a run created before revisions were kept: its mix as created
        rows = [_first_revision(run)]
    return [
        EnvRevision(r.revision, list(r.envs), r.weight_version, r.changed_by, r.created_at)
        for r in rows
    ]


def _stored(run: Run) -> StoredRun:
    return StoredRun(
        run.id, run.name, run.status, dict(run.config), run.weight_version, run.env_revision or 0
    )


def _first_revision(run: Run) -> RunEnvRevision:
    return RunEnvRevision(
        run_id=run.id,
        revision=0,
        envs=list(run.config.get("envs") or ()),
        weight_version=0,
        changed_by=CREATED_BY,
        created_at=run.created_at or _now(),
    )


def _now() -> datetime:
    return datetime.now(UTC)
