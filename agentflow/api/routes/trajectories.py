"""`/v1/trajectories`: one trajectory with the exact tokens the engine saw and made."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import API_KEY, TurnTreeDep
from agentflow.api.routing import GatewayRoute

router = APIRouter(
    prefix="/v1/trajectories", tags=["trajectories"], route_class=GatewayRoute, dependencies=API_KEY
)


@router.get("/{trajectory_id}")
async def get_trajectory(trajectory_id: uuid.UUID, turns: TurnTreeDep) -> dict[str, Any]:
    return asdict(await turns.trajectory(trajectory_id))
