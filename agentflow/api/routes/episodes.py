"""`/v1/episodes`: an episode with its whole turn tree."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import API_KEY, TurnTreeDep
from agentflow.api.routing import GatewayRoute

router = APIRouter(
    prefix="/v1/episodes", tags=["episodes"], route_class=GatewayRoute, dependencies=API_KEY
)


@router.get("/{episode_id}")
async def get_episode(episode_id: uuid.UUID, turns: TurnTreeDep) -> dict[str, Any]:
    """The episode and its turn tree: each node with tokens, log-probs, versions and mask."""
    return asdict(await turns.episode_tree(episode_id))
