"""`POST /v1/runs/{run_id}/weights`: switch a live run's engines to a new weight version.

A trainer in its own process publishes each version one of two ways:

- `disk` sync: an HF-format safetensors directory named by `path`. The directory must be
  readable at this path by the gateway and its engines (a shared or local filesystem):
  it is checked here, so a typo is a 422, not a failed engine update.
- `nccl` sync: `broadcast` names the group and the buckets the trainer is broadcasting
  while this request runs (trainer/broadcast_sync.py). The group is formed once, before:
  `GET .../weights/group` says how many engine ranks join it, and `POST
  .../weights/group` has them join (it answers when the trainer, rank 0, has too).

Either way the run manager pauses the run's engines under its partial-rollout policy,
switches them, resumes them and records the version. A run whose engine cannot take a
broadcast (a local engine) answers 409.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentflow.api.deps import API_KEY, RunManagerDep, SessionDep
from agentflow.api.routing import GatewayRoute
from agentflow.db.models import Run
from agentflow.errors import InvalidInput, NotFound
from agentflow.inference.base import BroadcastWeights, WeightGroup, WeightUpdate
from agentflow.integers import Int32

router = APIRouter(
    prefix="/v1/runs", tags=["weights"], route_class=GatewayRoute, dependencies=API_KEY
)


class WeightsPublish(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Int32 = Field(ge=1, description="the new weight version; newer than the run's")
    path: str | None = Field(
        default=None, min_length=1, description="HF-format safetensors directory to load"
    )
    broadcast: BroadcastWeights | None = Field(
        default=None, description="buckets the trainer broadcasts over the run's weight group"
    )

    @model_validator(mode="after")
    def _one_source(self) -> WeightsPublish:
        if (self.path is None) == (self.broadcast is None):
            raise ValueError("give exactly one of path or broadcast")
        return self


class WeightGroupRanks(BaseModel):
    ranks: int = Field(description="how many ranks the run's engines bring to a weight group")


class WeightGroupJoined(BaseModel):
    group_name: str


class WeightsPublished(BaseModel):
    version: int = Field(description="the version the run's engines now serve")


@router.post("/{run_id}/weights", response_model=WeightsPublished)
async def update_weights(
    run_id: uuid.UUID, body: WeightsPublish, session: SessionDep, manager: RunManagerDep
) -> WeightsPublished:
    await _known(session, run_id)
    if body.path is not None and not Path(body.path).is_dir():
        raise InvalidInput(f"{body.path!r} is not a directory here", field=("body", "path"))
    update = WeightUpdate(path=body.path, broadcast=body.broadcast, version=body.version)
    return WeightsPublished(version=await manager.update_weights(run_id, update))


@router.get("/{run_id}/weights/group", response_model=WeightGroupRanks)
async def weight_group_ranks(
    run_id: uuid.UUID, session: SessionDep, manager: RunManagerDep
) -> WeightGroupRanks:
    await _known(session, run_id)
    return WeightGroupRanks(ranks=await manager.weight_group_ranks(run_id))


@router.post("/{run_id}/weights/group", response_model=WeightGroupJoined)
async def join_weight_group(
    run_id: uuid.UUID, body: WeightGroup, session: SessionDep, manager: RunManagerDep
) -> WeightGroupJoined:
    await _known(session, run_id)
    await manager.join_weight_group(run_id, body)
    return WeightGroupJoined(group_name=body.group_name)


async def _known(session: SessionDep, run_id: uuid.UUID) -> None:
    if await session.get(Run, run_id) is None:
        raise NotFound(f"run {run_id} not found")
