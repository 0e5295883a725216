"""`/v1/envs`: the environment registry."""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status
from pydantic import ValidationError
from sqlalchemy import Select, bindparam, delete, func, select
from sqlalchemy.exc import IntegrityError

from agentflow.api.deps import API_KEY, SessionDep
from agentflow.api.errors import validation_error
from agentflow.api.routing import GatewayRoute
from agentflow.api.schemas.common import Page
from agentflow.api.schemas.envs import EnvCreate, EnvKind, EnvPublic, EnvUpdate
from agentflow.api.schemas.runs import ACTIVE_RUN_STATUSES
from agentflow.db.models import Environment, Run, RunEnvironment
from agentflow.db.session import read_connection
from agentflow.errors import Conflict, NotFound
from agentflow.integers import Int64
from envs.registry import parse_spec

router = APIRouter(prefix="/v1/envs", tags=["envs"], route_class=GatewayRoute, dependencies=API_KEY)


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


@functools.cache
def _list_queries(by_name: bool, by_kind: bool) -> tuple[Select[Any], Select[Any]]:
    """(count, page) of the env list for one combination of filters, values bound at run
    time. Built once: building a statement costs more than running it on a small table.
    Rows, not ORM objects: a page is only read and serialized, so the identity map and
    per-object state would be pure overhead."""
    query = select(Environment.__table__)
    if by_name:
        query = query.where(Environment.name == bindparam("name"))
    if by_kind:
        query = query.where(Environment.kind == bindparam("kind"))
    count = select(func.count()).select_from(query.subquery())
    page = query.order_by(Environment.created_at, Environment.id)
    return count, page.limit(bindparam("limit")).offset(bindparam("offset"))


@router.get("", response_model=Page[EnvPublic])
async def list_envs(
    session: SessionDep,
    name: str | None = None,
    kind: EnvKind | None = None,
    limit: Annotated[Int64, Query(ge=1, le=500)] = 50,
    offset: Annotated[Int64, Query(ge=0)] = 0,
) -> dict[str, object]:
    count, page = _list_queries(name is not None, kind is not None)
    params = {"name": name, "kind": kind, "limit": limit, "offset": offset}
    conn = await read_connection(session)
    total = await conn.scalar(count, params)
    rows = (await conn.execute(page, params)).mappings().all()
    return {"items": rows, "total": total or 0, "limit": limit, "offset": offset}


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
