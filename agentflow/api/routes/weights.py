"""`POST /v1/runs/{run_id}/weights`: switch a live run's engines to a new weight version.

A trainer in its own process publishes each version as an HF-format safetensors
directory (`disk` sync) and names it here; the run manager pauses the run's engines
under its partial-rollout policy, loads the directory, resumes them and records the
version. The directory must be readable at this path by the gateway and its engines
(a shared or local filesystem): it is checked here, so a typo is a 422, not a failed
engine update.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from agentflow.api.deps import API_KEY, RunManagerDep, SessionDep
from agentflow.api.routing import GatewayRoute
from agentflow.db.models import Run
from agentflow.errors import InvalidInput, NotFound
from agentflow.inference.base import WeightUpdate

router = APIRouter(
    prefix="/v1/runs", tags=["weights"], route_class=GatewayRoute, dependencies=API_KEY
)


class WeightsPublish(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="the new weight version; newer than the run's")
    path: str = Field(min_length=1, description="HF-format safetensors directory to load")


class WeightsPublished(BaseModel):
    version: int = Field(description="the version the run's engines now serve")


@router.post("/{run_id}/weights", response_model=WeightsPublished)
async def update_weights(
    run_id: uuid.UUID, body: WeightsPublish, session: SessionDep, manager: RunManagerDep
) -> WeightsPublished:
    if await session.get(Run, run_id) is None:
        raise NotFound(f"run {run_id} not found")
    if not Path(body.path).is_dir():
        raise InvalidInput(f"{body.path!r} is not a directory here", field=("body", "path"))
    update = WeightUpdate(path=body.path, version=body.version)
    return WeightsPublished(version=await manager.update_weights(run_id, update))
