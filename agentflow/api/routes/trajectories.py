"""`/v1/trajectories`: one trajectory with the exact tokens the engine saw and made."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import API_KEY, TurnTreeDep
from agentflow.api.routes.blobs import blob_url
from agentflow.api.routing import GatewayRoute

router = APIRouter(
    prefix="/v1/trajectories", tags=["trajectories"], route_class=GatewayRoute, dependencies=API_KEY
)


@router.get("/{trajectory_id}")
async def get_trajectory(trajectory_id: uuid.UUID, turns: TurnTreeDep) -> dict[str, Any]:
    """The trajectory, and `turn_images`: per turn of `turn_ids`, its images' blob ids and
    URLs (an empty list for a turn without images)."""
    trajectory = await turns.trajectory(trajectory_id)
    images = await turns.images_of(trajectory.turn_ids)
    body = asdict(trajectory)
    body["turn_images"] = [
        [{"sha256": sha256, "url": blob_url(sha256)} for sha256 in images.get(turn_id, ())]
        for turn_id in trajectory.turn_ids
    ]
    return body
