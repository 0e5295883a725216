"""`/v1/episodes`: an episode with its whole turn tree."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from agentflow.api.deps import API_KEY, TurnTreeDep
from agentflow.api.routes.blobs import blob_url
from agentflow.api.routing import GatewayRoute

router = APIRouter(
    prefix="/v1/episodes", tags=["episodes"], route_class=GatewayRoute, dependencies=API_KEY
)


def _with_image_urls(node: dict[str, Any]) -> dict[str, Any]:
    node["image_urls"] = [blob_url(sha256) for sha256 in node["images"]]
    for child in node["children"]:
        _with_image_urls(child)
    return node


@router.get("/{episode_id}")
async def get_episode(episode_id: uuid.UUID, turns: TurnTreeDep) -> dict[str, Any]:
    """The episode and its turn tree: each node with tokens, log-probs, versions and mask,
    and its images as blob ids (`images`) and where to fetch them (`image_urls`)."""
    tree = asdict(await turns.episode_tree(episode_id))
    for root in tree["roots"]:
        _with_image_urls(root)
    return tree
