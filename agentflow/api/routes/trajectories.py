"""`/v1/trajectories`: one trajectory with the exact tokens the engine saw and made."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import TurnTreeDep

router = APIRouter(prefix="/v1/trajectories", tags=["trajectories"])


@router.get("/{trajectory_id}")
async def get_trajectory(trajectory_id: uuid.UUID, turns: TurnTreeDep) -> dict[str, Any]:
    return asdict(await turns.trajectory(trajectory_id))
