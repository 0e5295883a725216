"""`/v1/runs/{id}/trajectories/lease|ack|reject`: the trajectory stream over HTTP.

The split form's trainer (`agentflow trainer --gateway URL`) leases and acknowledges
through these; they run the same `DbTrajectoryStream` code as the embedded trainer.

A lease carries whole trajectories (tokens, log-probs, masks): it is encoded by orjson
straight from the dataclasses, not walked by FastAPI's encoder (`bench/lease_latency.py`
measures both).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import orjson
from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentflow.api.deps import API_KEY, RunManagerDep
from agentflow.api.routing import GatewayRoute
from agentflow.integers import Int64
from agentflow.types import Trajectory

router = APIRouter(
    prefix="/v1/runs/{run_id}/trajectories",
    tags=["trajectory stream"],
    route_class=GatewayRoute,
    dependencies=API_KEY,
)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_n: Int64 = Field(ge=1, le=4096, description="at most this many trajectories")
    min_n: Int64 = Field(
        default=1, ge=1, le=4096, description="wait for this many (at most max_n) ..."
    )
    timeout_s: float = Field(
        default=0.0, ge=0, le=60, description="... this long; then what there is comes back"
    )
    lease_id: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="the caller's id for this lease: a resent pull with it gets the "
        "trajectories still leased under it instead of more",
    )

    @field_validator("min_n")
    @classmethod
    def _at_most_max_n(cls, value: int, info: ValidationInfo) -> int:
        max_n = info.data.get("max_n")
        if max_n is not None and value > max_n:
            raise ValueError(f"min_n must be at most max_n ({max_n})")
        return value


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[uuid.UUID] = Field(max_length=100_000, description="trajectories trained on")
    lease_id: str | None = Field(
        default=None, max_length=32, description="the lease they came with; None: the latest"
    )


class RejectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: uuid.UUID
    lease_id: str | None = Field(default=None, max_length=32)
    error: str = Field(min_length=1, max_length=10_000, description="why the trainer refused it")


@router.post("/lease", response_model=None)
async def lease(run_id: uuid.UUID, body: LeaseRequest, manager: RunManagerDep) -> Response:
    """`{"trajectories": [...]}`, each a `Trajectory` as JSON."""
    stream = await manager.stream(run_id)
    served = await stream.pull(body.max_n, body.timeout_s, body.lease_id, min_n=body.min_n)
    return Response(lease_body(served), media_type="application/json")


def lease_body(served: Sequence[Trajectory]) -> bytes:
    return orjson.dumps({"trajectories": served}, default=_uuid_text)


def _uuid_text(value: object) -> str:
    """UUIDs orjson does not know as such: asyncpg's own UUID type, a subclass."""
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@router.post("/ack")
async def ack(run_id: uuid.UUID, body: AckRequest, manager: RunManagerDep) -> dict[str, int]:
    stream = await manager.stream(run_id)
    return {"acked": await stream.ack(body.ids, body.lease_id)}


@router.post("/reject", status_code=204)
async def reject(run_id: uuid.UUID, body: RejectRequest, manager: RunManagerDep) -> None:
    stream = await manager.stream(run_id)
    await stream.reject(body.id, body.lease_id, body.error)


@router.post("/reclaim")
async def reclaim(run_id: uuid.UUID, manager: RunManagerDep) -> dict[str, int]:
    """A (re)starting trainer takes back the leases its predecessor held."""
    stream = await manager.stream(run_id)
    return {"reclaimed": await stream.reclaim()}
