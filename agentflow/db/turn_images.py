"""The images of turns: stored once each as blobs, linked from `turn_blobs` in order.

A batch of turns is written with its images in one transaction: the blobs (bytes and
rows, skipping those already stored, each distinct image once however many turns show
it), then the turns, then the links. Links are a table rather than a list on the turn
row so the database itself guarantees a link names a stored blob (docs/decisions.md,
"Images as blobs").
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, insert, select

from agentflow.db import blobs
from agentflow.db.blobs import BlobStore, Connection, NewBlob
from agentflow.db.models import TurnBlob
from agentflow.images import blob_id, check_image
from agentflow.types import NewTurn

turn_blobs = cast(Table, TurnBlob.__table__)
_CHUNK = 500


def has_images(batch: Sequence[NewTurn]) -> bool:
    return any(turn.record.images for turn in batch)


def gather(batch: Sequence[NewTurn]) -> tuple[list[NewBlob], list[dict[str, Any]]]:
    """The distinct new blobs of `batch` (hashed once each) and its link rows."""
    new: dict[str, NewBlob] = {}
    links: list[dict[str, Any]] = []
    for turn in batch:
        for position, image in enumerate(turn.record.images):
            if isinstance(image, bytes):
                sha256 = blob_id(image)
                if sha256 not in new:
                    new[sha256] = NewBlob(sha256, check_image(image), image)
            else:
                sha256 = image
            links.append({"turn_id": turn.id, "position": position, "sha256": sha256})
    return list(new.values()), links


async def store_blobs(
    conn: Connection, store: BlobStore, batch: Sequence[NewTurn]
) -> list[dict[str, Any]]:
    """Store the batch's images (before its turns); the link rows to insert after them."""
    new, links = gather(batch)
    if new:
        await blobs.save(conn, store, new)
    return links


async def link(conn: Connection, links: Sequence[dict[str, Any]]) -> None:
    if links:
        await conn.execute(insert(turn_blobs), list(links))


async def images_of(
    conn: Connection, turn_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, tuple[str, ...]]:
    """Each turn's blob ids in order; turns without images are absent."""
    found: dict[uuid.UUID, list[str]] = defaultdict(list)
    ids = list(dict.fromkeys(turn_ids))
    for start in range(0, len(ids), _CHUNK):
        rows = await conn.execute(
            select(turn_blobs.c.turn_id, turn_blobs.c.sha256)
            .where(turn_blobs.c.turn_id.in_(ids[start : start + _CHUNK]))
            .order_by(turn_blobs.c.turn_id, turn_blobs.c.position)
        )
        for row in rows:
            found[row.turn_id].append(row.sha256)
    return {turn: tuple(shas) for turn, shas in found.items()}
