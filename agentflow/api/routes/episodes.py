"""`/v1/episodes`: an episode with its whole turn tree."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import SessionMakerDep

router = APIRouter(prefix="/v1/episodes", tags=["episodes"])


@router.get("/{episode_id}")
async def get_episode(episode_id: uuid.UUID, maker: SessionMakerDep) -> dict[str, Any]:
    """The episode and its turn tree: each node with tokens, log-probs, versions and mask."""
    from agentflow.db.turn_tree import TurnTree

    return asdict(await TurnTree(maker).episode_tree(episode_id))
