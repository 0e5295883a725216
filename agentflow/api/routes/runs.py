"""`/v1/runs`: run configs, their status and episodes, and control of live runs."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from agentflow.api.deps import API_KEY, RunManagerDep, SessionDep
from agentflow.api.routing import GatewayRoute
from agentflow.api.schemas.common import Page
from agentflow.api.schemas.runs import (
    EnvRevisionPublic,
    EpisodePublic,
    RunDetail,
    RunPublic,
    RunStatus,
)
from agentflow.db.models import Episode, Run, WeightVersion
from agentflow.db.runs import read_env_revisions
from agentflow.env_curves import env_curves
from agentflow.errors import InvalidInput, NotFound
from agentflow.integers import Int32, Int64
from agentflow.run_config import EnvMixChange, RunConfig
from agentflow.types import EpisodeStatus

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=GatewayRoute, dependencies=API_KEY)
# A run's own page and controls: what `agentflow train --ui-port` also serves for the run
# it trains (the rest, creating runs among it, belongs to the gateway alone).
controls = APIRouter(
    prefix="/v1/runs", tags=["runs"], route_class=GatewayRoute, dependencies=API_KEY
)


async def _get(session: SessionDep, run_id: uuid.UUID) -> Run:
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic)
async def create_run(
    config: RunConfig,
    session: SessionDep,
    manager: RunManagerDep,
    start: Annotated[bool, Query(description="start playing episodes now")] = True,
) -> Run:
    if config.warm_start.enabled:
        # The gateway plays a run; only `agentflow train` runs the warm start first.
        raise InvalidInput(
            "the gateway does not run a warm start: run `agentflow sft` and set model.path "
            "to its output",
            field=("body", "warm_start", "enabled"),
        )
    try:
        run_id = await manager.create(config, start=start)
    except InvalidInput as exc:
        raise InvalidInput(exc.message, field=("body", *exc.field)) from None
    return await _get(session, run_id)


@router.get("", response_model=Page[RunPublic])
async def list_runs(
    session: SessionDep,
    name: str | None = None,
    status: RunStatus | None = None,
    limit: Annotated[Int64, Query(ge=1, le=500)] = 50,
    offset: Annotated[Int64, Query(ge=0)] = 0,
) -> dict[str, object]:
    query = select(Run)
    if name is not None:
        query = query.where(Run.name == name)
    if status is not None:
        query = query.where(Run.status == status)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    rows = await session.scalars(
        query.order_by(Run.created_at.desc(), Run.id).limit(limit).offset(offset)
    )
    return {"items": list(rows), "total": total or 0, "limit": limit, "offset": offset}


@controls.get("/{run_id}", response_model=RunDetail)
async def get_run(run_id: uuid.UUID, session: SessionDep) -> RunDetail:
    """The run, with its env mix now and the mix's revisions."""
    return await run_detail(session, await _get(session, run_id))


@controls.patch("/{run_id}", response_model=RunDetail)
async def change_run_envs(
    run_id: uuid.UUID,
    change: EnvMixChange,
    request: Request,
    session: SessionDep,
    manager: RunManagerDep,
) -> RunDetail:
    """Change the run's env mix (add, remove, reweight, recap): stored as its next
    revision, in effect for the groups admitted after it (docs/runs.md, "Changing the
    mix of a live run"). 404 for an unknown run (from the manager's own read)."""
    client = request.client.host if request.client is not None else "unknown"
    try:
        await manager.change_envs(run_id, change, changed_by=f"api from {client}")
    except InvalidInput as exc:
        raise InvalidInput(exc.message, field=("body", *exc.field)) from None
    # This request's session is first used here: never two pooled connections at once.
    return await run_detail(session, await _get(session, run_id))


async def run_detail(session: SessionDep, run: Run) -> RunDetail:
    revisions = await read_env_revisions(session, run)
    return RunDetail.model_validate(
        {
            **RunPublic.model_validate(run).model_dump(),
            "envs": list(run.config.get("envs") or ()),
            "env_revisions": [EnvRevisionPublic.model_validate(r) for r in revisions],
        }
    )


@router.get("/{run_id}/episodes", response_model=Page[EpisodePublic])
async def list_run_episodes(
    run_id: uuid.UUID,
    session: SessionDep,
    status: EpisodeStatus | None = None,
    limit: Annotated[Int64, Query(ge=1, le=1000)] = 100,
    offset: Annotated[Int64, Query(ge=0)] = 0,
) -> dict[str, Any]:
    await _get(session, run_id)
    query = select(Episode).where(Episode.run_id == run_id)
    if status is not None:
        query = query.where(Episode.status == status)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    rows = await session.scalars(
        query.order_by(Episode.created_at, Episode.id).limit(limit).offset(offset)
    )
    return {"items": list(rows), "total": total or 0, "limit": limit, "offset": offset}


@controls.post("/{run_id}/pause", response_model=RunPublic)
async def pause_run(run_id: uuid.UUID, session: SessionDep, manager: RunManagerDep) -> Run:
    await _get(session, run_id)
    await (await manager.live(run_id)).pause()
    return await _fresh(session, run_id)


@controls.post("/{run_id}/resume", response_model=RunPublic)
async def resume_run(run_id: uuid.UUID, session: SessionDep, manager: RunManagerDep) -> Run:
    await _get(session, run_id)
    await (await manager.live(run_id)).resume()
    return await _fresh(session, run_id)


@controls.post("/{run_id}/stop", response_model=RunPublic)
async def stop_run(run_id: uuid.UUID, session: SessionDep, manager: RunManagerDep) -> Run:
    await _get(session, run_id)
    await (await manager.live(run_id)).stop("stopped through the API")
    return await _fresh(session, run_id)


async def _fresh(session: SessionDep, run_id: uuid.UUID) -> Run:
    session.expire_all()
    return await _get(session, run_id)


class MetricsRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Int32 = Field(ge=0, description="the weight version the step produced")
    metrics: dict[str, float] = Field(max_length=1000, description="the step's numbers")
    step: Int32 | None = Field(
        default=None,
        ge=1,
        description="the trainer step (an Integer column): replaces the metrics an older "
        "version holds for this step or a later one (steps done again after a resume)",
    )


@router.post("/{run_id}/metrics", status_code=204)
async def record_run_metrics(
    run_id: uuid.UUID, body: MetricsRecord, session: SessionDep, manager: RunManagerDep
) -> None:
    """A trainer step's metrics (the split trainer sends each step's): stored with the
    weight version, and exported on `/metrics`. Idempotent, and one row per `step`."""
    await _get(session, run_id)
    await manager.record_metrics(run_id, body.version, body.metrics, body.step)


@router.get("/{run_id}/metrics")
async def run_metrics(run_id: uuid.UUID, session: SessionDep) -> dict[str, Any]:
    """The trainer's metrics per weight version (one per step), oldest first; each env's
    curves (`envs`) and the env mix's revisions."""
    run = await _get(session, run_id)
    versions = list(
        await session.scalars(
            select(WeightVersion)
            .where(WeightVersion.run_id == run_id)
            .order_by(WeightVersion.version)
        )
    )
    revisions = await read_env_revisions(session, run)
    return {
        "run_id": str(run_id),
        "weight_version": run.weight_version,
        "versions": [
            {
                "version": w.version,
                "created_at": w.created_at,
                "uri": w.uri,
                "step": w.step,
                "metrics": w.metrics,
            }
            for w in versions
        ],
        # Each env's figures per version, and when the mix changed (to mark on them).
        "envs": env_curves((w.version, w.metrics or {}) for w in versions),
        "env_revisions": [EnvRevisionPublic.model_validate(r) for r in revisions],
    }
