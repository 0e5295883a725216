"""`/v1/blobs`: stored images (screenshots, agents' image parts) by content id.

A blob's id is the SHA-256 of its bytes, so a response never changes: it is served with
its media type and cached as immutable. Turns list the ids of their blobs
(`GET /v1/episodes/{id}`, `GET /v1/trajectories/{id}`) with these URLs.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from agentflow.api.deps import API_KEY, TurnTreeDep
from agentflow.api.routing import GatewayRoute
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import InvalidInput
from agentflow.images import is_blob_id

router = APIRouter(
    prefix="/v1/blobs", tags=["blobs"], route_class=GatewayRoute, dependencies=API_KEY
)


def blob_url(sha256: str) -> str:
    """Where a blob is served, relative to the gateway's root (so it survives proxies)."""
    return f"{router.prefix}/{sha256}"


@router.get(
    "/{sha256}",
    response_class=Response,
    responses={200: {"content": {"image/png": {}, "image/jpeg": {}}}},
)
async def get_blob(sha256: str, turns: TurnTreeDep) -> Response:
    """The blob's bytes with its media type; 404 when no blob has this id."""
    return await blob_response(sha256, turns)


async def blob_response(sha256: str, turns: TurnTree) -> Response:
    """A blob as served (here, and to the dashboard's pages)."""
    if not is_blob_id(sha256):
        raise InvalidInput(
            "a blob id is the SHA-256 of its bytes: 64 lower-case hex digits",
            field=("path", "sha256"),
        )
    found, data = await turns.blob(sha256)
    return Response(
        content=data,
        media_type=found.media_type,
        headers={"Cache-Control": "private, max-age=31536000, immutable", "ETag": f'"{sha256}"'},
    )
