"""`/v1/trajectories`: one trajectory with the exact tokens the engine saw and made."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import SessionMakerDep

router = APIRouter(prefix="/v1/trajectories", tags=["trajectories"])


@router.get("/{trajectory_id}")
async def get_trajectory(trajectory_id: uuid.UUID, maker: SessionMakerDep) -> dict[str, Any]:
    from agentflow.db.turn_tree import TurnTree

    return asdict(await TurnTree(maker).trajectory(trajectory_id))
