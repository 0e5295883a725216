"""What the dashboard's pages show, read from the database (and the live runs' engines).

Every list is paged in SQL and ordered by an index (`ix_episodes_run_id_created_at` for
a run's episodes), so a page costs the same with ten episodes or a million. Rows are read
as plain rows, not ORM objects: a page is only serialized.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.db.models import Environment, Episode, Run, RunEnvRevision, Turn, WeightVersion
from agentflow.db.runs import LIVE_RUN_STATUSES
from agentflow.db.turn_tree import TurnTree
from agentflow.env_curves import env_curves
from agentflow.errors import NotFound
from agentflow.types import OPEN_EPISODE_STATUSES, EpisodeInfo, TurnNode
from agentflow.ui.tokens import TokenTexts

# An engine that does not answer this fast shows as down: a page never waits on it.
ENGINE_INFO_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class EpisodeFilter:
    status: str | None = None
    env: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    weight_version: int | None = None  # episodes with a token sampled at this version


def _counts_by_status(rows: Sequence[Any]) -> dict[str, int]:
    return {status: int(count) for status, count in rows}


async def run_list(session: AsyncSession, *, limit: int, offset: int) -> dict[str, Any]:
    total = await session.scalar(select(func.count()).select_from(Run))
    runs = (
        await session.execute(
            select(
                Run.id,
                Run.name,
                Run.status,
                Run.weight_version,
                Run.error,
                Run.config,
                Run.created_at,
                Run.updated_at,
            )
            .order_by(Run.created_at.desc(), Run.id)
            .limit(limit)
            .offset(offset)
        )
    ).all()
    ids = [run.id for run in runs]
    counts: dict[uuid.UUID, dict[str, int]] = {run_id: {} for run_id in ids}
    if ids:
        grouped = await session.execute(
            select(Episode.run_id, Episode.status, func.count())
            .where(Episode.run_id.in_(ids))
            .group_by(Episode.run_id, Episode.status)
        )
        for run_id, status, count in grouped:
            if run_id is not None:
                counts[run_id][status] = int(count)
    items = [
        {
            "id": run.id,
            "name": run.name,
            "status": run.status,
            "weight_version": run.weight_version,
            "error": run.error,
            "algorithm": (run.config.get("trainer") or {}).get("algorithm", "grpo"),
            "created_at": run.created_at,
            "updated_at": run.updated_at,
            "episodes": counts[run.id],
        }
        for run in runs
    ]
    return {"items": items, "total": total or 0, "limit": limit, "offset": offset}


async def run_detail(session: AsyncSession, run_id: uuid.UUID) -> dict[str, Any]:
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    statuses = await session.execute(
        select(Episode.status, func.count())
        .where(Episode.run_id == run_id)
        .group_by(Episode.status)
    )
    envs = await session.execute(
        select(Episode.env_ref, func.count())
        .where(Episode.run_id == run_id)
        .group_by(Episode.env_ref)
        .order_by(Episode.env_ref)
    )
    revisions = list(
        await session.scalars(
            select(RunEnvRevision)
            .where(RunEnvRevision.run_id == run_id)
            .order_by(RunEnvRevision.revision)
        )
    )
    versions = (
        await session.execute(
            select(WeightVersion.version, WeightVersion.metrics, WeightVersion.created_at)
            .where(WeightVersion.run_id == run_id)
            .order_by(WeightVersion.version)
        )
    ).all()
    return {
        "id": run.id,
        "name": run.name,
        "status": run.status,
        "weight_version": run.weight_version,
        "error": run.error,
        "config": run.config,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "episodes": _counts_by_status(statuses.all()),
        "envs": {env_ref: int(count) for env_ref, count in envs},
        "curves": curves(run.created_at, versions),
        "env_curves": env_curves((row.version, row.metrics or {}) for row in versions),
        "mix": {"revision": run.env_revision, "envs": run.config.get("envs") or []},
        "env_revisions": [
            {
                "revision": r.revision,
                "weight_version": r.weight_version,
                "created_at": r.created_at,
                "changed_by": r.changed_by,
                "envs": r.envs,
            }
            for r in revisions
        ],
    }


def curves(started: datetime, versions: Sequence[Any]) -> dict[str, Any]:
    """Each metric as points `[version, value]`, one per weight version that reported it
    (a trainer step reports its metrics with the version it produced), plus the
    throughput: trajectories trained per second of wall time since the version before."""
    series: dict[str, list[list[float]]] = {}
    previous = started
    for row in versions:
        metrics = row.metrics or {}
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, []).append([row.version, float(value)])
        elapsed = (row.created_at - previous).total_seconds()
        trajectories = metrics.get("trajectories")
        if isinstance(trajectories, int | float) and elapsed > 0:
            series.setdefault("throughput", []).append([row.version, trajectories / elapsed])
        previous = row.created_at
    return {"series": series, "steps": len(series.get("reward", []))}


async def episode_page(
    session: AsyncSession, run_id: uuid.UUID, where: EpisodeFilter, *, limit: int, offset: int
) -> dict[str, Any]:
    if await session.scalar(select(Run.id).where(Run.id == run_id)) is None:
        raise NotFound(f"run {run_id} not found")
    conditions = [Episode.run_id == run_id]
    if where.status is not None:
        conditions.append(Episode.status == where.status)
    if where.env is not None:
        conditions.append(Episode.env_ref == where.env)
    if where.reward_min is not None:
        conditions.append(Episode.reward >= where.reward_min)
    if where.reward_max is not None:
        conditions.append(Episode.reward <= where.reward_max)
    if where.weight_version is not None:
        conditions.append(Episode.min_weight_version <= where.weight_version)
        conditions.append(Episode.max_weight_version >= where.weight_version)
    total = await session.scalar(select(func.count()).select_from(Episode).where(*conditions))
    rows = (
        await session.execute(
            select(
                Episode.id,
                Episode.env_ref,
                Episode.group_id,
                Episode.status,
                Episode.reward,
                Episode.error,
                Episode.min_weight_version,
                Episode.max_weight_version,
                Episode.created_at,
                Episode.finished_at,
            )
            .where(*conditions)
            .order_by(Episode.created_at.desc(), Episode.id.desc())
            .limit(limit)
            .offset(offset)
        )
    ).all()
    turns: dict[uuid.UUID, int] = {}
    if rows:
        counted = await session.execute(
            select(Turn.episode_id, func.count())
            .where(Turn.episode_id.in_([row.id for row in rows]))
            .group_by(Turn.episode_id)
        )
        turns = {episode_id: int(count) for episode_id, count in counted}
    items = [{**row._asdict(), "turns": turns.get(row.id, 0)} for row in rows]
    return {"items": items, "total": total or 0, "limit": limit, "offset": offset}


async def episode_detail(
    session: AsyncSession, turn_tree: TurnTree, token_texts: TokenTexts, episode_id: uuid.UUID
) -> dict[str, Any]:
    tree = await turn_tree.episode_tree(episode_id)
    run = None if tree.run_id is None else await session.get(Run, tree.run_id)
    config = run.config if run is not None else {}
    tokenizer = await asyncio.to_thread(token_texts.tokenizer, tree.run_id, config)
    trained = {t.leaf_turn_id: t.reward for t in tree.trajectories}

    def node(turn: TurnNode) -> dict[str, Any]:
        return {
            "id": turn.id,
            "parent_id": turn.parent_id,
            "depth": turn.depth,
            "kind": turn.kind,
            "text": turn.text,
            "reward": turn.reward,
            "finish_reason": turn.finish_reason,
            "timings": turn.timings,
            "created_at": turn.created_at,
            "token_ids": turn.token_ids,
            "token_texts": TokenTexts.texts(tokenizer, turn.token_ids),
            "logprobs": turn.logprobs,
            "weight_versions": turn.weight_versions,
            "loss_mask": turn.loss_mask,
            "images": [f"/ui/api/blobs/{sha256}" for sha256 in turn.images],
            # A leaf that became a trajectory, with the return it was trained on.
            "trajectory_reward": trained.get(turn.id),
            "is_trajectory": turn.id in trained,
            "children": [node(child) for child in turn.children],
        }

    return {
        **{f.name: getattr(tree, f.name) for f in fields(EpisodeInfo)},
        "run_name": None if run is None else run.name,
        "live": tree.status in OPEN_EPISODE_STATUSES,
        "roots": [node(root) for root in tree.roots],
    }


async def env_list(session: AsyncSession) -> dict[str, Any]:
    """Registered envs with their live sessions (open episodes), and the built-in envs
    (named by id) that live runs play or live episodes use."""
    live = dict(
        (
            await session.execute(
                select(Episode.env_ref, func.count())
                .where(Episode.status.in_(sorted(OPEN_EPISODE_STATUSES)))
                .group_by(Episode.env_ref)
            )
        ).all()
    )
    live_by_id = dict(
        (
            await session.execute(
                select(Episode.environment_id, func.count())
                .where(Episode.status.in_(sorted(OPEN_EPISODE_STATUSES)))
                .where(Episode.environment_id.is_not(None))
                .group_by(Episode.environment_id)
            )
        ).all()
    )
    registered = (
        await session.execute(
            select(Environment.__table__).order_by(Environment.name, Environment.version)
        )
    ).mappings()
    items, claimed = [], set()
    for env in registered:
        refs = {str(env["id"]), env["name"], f"{env['name']}@{env['version']}"}
        claimed |= refs
        items.append(
            {
                **env,
                "live_sessions": int(live_by_id.get(env["id"], 0)),
            }
        )
    # Built-in envs: those live runs play (from their configs), and any with live sessions.
    in_use = dict.fromkeys(live, 0)
    configs = await session.scalars(select(Run.config).where(Run.status.in_(LIVE_RUN_STATUSES)))
    for config in configs:
        for env in config.get("envs") or []:
            if isinstance(env, dict) and isinstance(env.get("id"), str):
                in_use.setdefault(env["id"], 0)
    unregistered = [
        {"env_ref": ref, "live_sessions": int(live.get(ref, 0))}
        for ref in sorted(in_use)
        if ref not in claimed
    ]
    return {"items": items, "unregistered": unregistered}


async def engine_list(session: AsyncSession, runtimes: RuntimeRegistry) -> dict[str, Any]:
    """Each live run's policy engine: its queue, batch and KV use."""
    live = runtimes.items()
    names = (
        dict(
            (
                await session.execute(
                    select(Run.id, Run.name).where(Run.id.in_([run_id for run_id, _ in live]))
                )
            ).all()
        )
        if live
        else {}
    )

    async def info(run_id: uuid.UUID) -> dict[str, Any]:
        runtime = runtimes.get(run_id)
        try:
            async with asyncio.timeout(ENGINE_INFO_TIMEOUT_S):
                found = await runtime.engine.info()
        except Exception as exc:  # noqa: BLE001 - shown as down, with why
            return {"run_id": run_id, "run_name": names.get(run_id), "up": False, "error": str(exc)}
        extra = found.extra
        return {
            "run_id": run_id,
            "run_name": names.get(run_id),
            "up": True,
            "engine": type(runtime.engine).__name__,
            "model": found.model,
            "weight_version": found.weight_version,
            "paused": found.paused,
            "running": found.running,
            "waiting": found.waiting,
            "sessions": found.sessions,
            "kv_tokens": found.kv_tokens,
            "kv_budget_tokens": extra.get("kv_budget_tokens"),
            "max_batch_size": extra.get("max_batch_size"),
            "max_context": found.max_context,
            "extra": {k: v for k, v in extra.items() if k != "server_info"},
        }

    return {"items": list(await asyncio.gather(*(info(run_id) for run_id, _ in live)))}
