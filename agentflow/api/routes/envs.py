"""`/v1/envs`: the environment registry."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from pydantic import ValidationError
from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError

from agentflow.api.deps import SessionDep
from agentflow.api.errors import validation_error
from agentflow.api.schemas.common import Page
from agentflow.api.schemas.envs import EnvCreate, EnvPublic, EnvUpdate
from agentflow.api.schemas.runs import ACTIVE_RUN_STATUSES
from agentflow.db.models import Environment, Run, RunEnvironment
from agentflow.errors import Conflict, NotFound
from envs.specs import EnvKind, parse_spec

router = APIRouter(prefix="/v1/envs", tags=["envs"])


def _validated_spec(kind: str, spec: dict[str, object]) -> dict[str, object]:
    try:
        parsed = parse_spec(kind, spec)
    except ValidationError as exc:
        # Errors point into the discriminated union's branch; keep only the field path.
        raise validation_error(exc, prefix=("body", "spec")) from None
    return parsed.model_dump(mode="json", exclude={"kind"})


async def _get(session: SessionDep, env_id: uuid.UUID) -> Environment:
    env = await session.get(Environment, env_id)
    if env is None:
        raise NotFound(f"environment {env_id} not found")
    return env


@router.post("", status_code=status.HTTP_201_CREATED, response_model=EnvPublic)
async def create_env(body: EnvCreate, session: SessionDep) -> Environment:
    env = Environment(
        name=body.name,
        version=body.version,
        kind=body.kind,
        spec=_validated_spec(body.kind, body.spec),
        tools=[t.model_dump(mode="json") for t in body.tools],
        max_concurrency=body.max_concurrency,
        step_timeout_s=body.step_timeout_s,
        description=body.description,
    )
    session.add(env)
    try:
        await session.commit()
    except IntegrityError:
        raise Conflict(f"environment {body.name!r} version {body.version!r} exists") from None
    return env


@router.get("", response_model=Page[EnvPublic])
async def list_envs(
    session: SessionDep,
    name: str | None = None,
    kind: EnvKind | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, object]:
    query = select(Environment)
    if name is not None:
        query = query.where(Environment.name == name)
    if kind is not None:
        query = query.where(Environment.kind == kind)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    rows = await session.scalars(
        query.order_by(Environment.created_at, Environment.id).limit(limit).offset(offset)
    )
    return {"items": list(rows), "total": total or 0, "limit": limit, "offset": offset}


@router.get("/{env_id}", response_model=EnvPublic)
async def get_env(env_id: uuid.UUID, session: SessionDep) -> Environment:
    return await _get(session, env_id)


@router.patch("/{env_id}", response_model=EnvPublic)
async def update_env(env_id: uuid.UUID, body: EnvUpdate, session: SessionDep) -> Environment:
    env = await _get(session, env_id)
    changes = body.model_dump(exclude_unset=True)
    if "spec" in changes and changes["spec"] is not None:
        env.spec = _validated_spec(env.kind, changes.pop("spec"))
    if changes.get("tools") is not None:
        env.tools = [t.model_dump(mode="json") for t in body.tools or []]
        changes.pop("tools")
    for field, value in changes.items():
        if value is not None:
            setattr(env, field, value)
    await session.commit()
    await session.refresh(env)
    return env


@router.delete("/{env_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_env(env_id: uuid.UUID, session: SessionDep) -> Response:
    env = await _get(session, env_id)
    active = await session.scalar(
        select(Run.id)
        .join(RunEnvironment, RunEnvironment.run_id == Run.id)
        .where(RunEnvironment.environment_id == env_id, Run.status.in_(ACTIVE_RUN_STATUSES))
        .limit(1)
    )
    if active is not None:
        raise Conflict(f"environment {env_id} is used by active run {active}")
    # Finished runs keep their config; only the link that guards deletion goes.
    await session.execute(delete(RunEnvironment).where(RunEnvironment.environment_id == env_id))
    await session.delete(env)
    await session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
