"""`/v1/runs`: run configs, validated and stored with their status."""

from __future__ import annotations

import re
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from agentflow.api.deps import SessionDep
from agentflow.api.schemas.common import Page
from agentflow.api.schemas.runs import RunPublic, RunStatus
from agentflow.db.models import Environment, Run, RunEnvironment
from agentflow.errors import InvalidInput, NotFound
from agentflow.run_config import RunConfig

router = APIRouter(prefix="/v1/runs", tags=["runs"])

_BUILTIN_ID = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+-v\d+$")


def _is_builtin(env_id: str) -> bool:
    if not _BUILTIN_ID.match(env_id):
        return False
    from envs import registry  # imported late: registering built-ins imports their modules

    return env_id in registry.registered()


async def _resolve_envs(session: AsyncSession, config: RunConfig) -> list[uuid.UUID]:
    """Registered envs a run names (by `name` or `name@version`); built-in ids need none."""
    linked: list[uuid.UUID] = []
    for index, entry in enumerate(config.envs):
        name, _, version = entry.id.partition("@")
        query = select(Environment.id).where(Environment.name == name)
        if version:
            query = query.where(Environment.version == version)
        env_id = await session.scalar(query.order_by(Environment.created_at.desc()).limit(1))
        if env_id is not None:
            linked.append(env_id)
        elif version or not _is_builtin(entry.id):
            raise InvalidInput(
                f"unknown environment {entry.id!r}: register it (POST /v1/envs) "
                "or name a built-in env id",
                field=("body", "envs", str(index), "id"),
            )
    return list(dict.fromkeys(linked))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic)
async def create_run(config: RunConfig, session: SessionDep) -> Run:
    env_ids = await _resolve_envs(session, config)
    run = Run(name=config.name, config=config.model_dump(mode="json"), status="pending")
    session.add(run)
    await session.flush()
    session.add_all(RunEnvironment(run_id=run.id, environment_id=e) for e in env_ids)
    await session.commit()
    return run


@router.get("", response_model=Page[RunPublic])
async def list_runs(
    session: SessionDep,
    name: str | None = None,
    status: RunStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
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


@router.get("/{run_id}", response_model=RunPublic)
async def get_run(run_id: uuid.UUID, session: SessionDep) -> Run:
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run
