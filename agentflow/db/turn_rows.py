"""Conversions between turn-tree value types (`agentflow.types`) and table rows.

Kept apart from the repository so that the SQL in `turn_tree` reads on its own. The hot
paths (rows for a batch insert, a context from its path rows) pack and unpack whole
arrays at once with numpy.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, cast

import numpy as np

from agentflow import ids
from agentflow.db.packing import (
    int_view,
    pack_floats,
    pack_ints,
    pack_mask,
    unpack_floats,
    unpack_ints,
    unpack_mask,
)
from agentflow.errors import InvalidInput
from agentflow.types import (
    Context,
    EpisodeInfo,
    EpisodeStatus,
    NewTurn,
    StoredTurn,
    TrajectoryRef,
    TrajectoryStatus,
    TurnKind,
)

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
# Bytes of one non-policy token in a packed array: float32 0.0 is all zero bits and int32 -1
# is all one bits, so placeholders are plain byte runs and need no per-token work.
_NO_LOGPROB = b"\x00\x00\x00\x00"
_NO_VERSION = b"\xff\xff\xff\xff"


def aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything stored is UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


# A turn row's columns, in the order of `turn_values`.
TURN_ROW_COLUMNS = (
    "id",
    "episode_id",
    "parent_id",
    "depth",
    "kind",
    "token_ids",
    "logprobs",
    "weight_versions",
    "loss_mask",
    "text",
    "reward",
    "finish_reason",
    "timings",
    "created_at",
)


def turn_values(turn: NewTurn, depth: int, created_at: datetime) -> tuple[Any, ...]:
    """The row of `turn` as values in `TURN_ROW_COLUMNS` order (text and timings as the
    record holds them)."""
    record = turn.record
    return (
        turn.id,
        turn.episode_id,
        turn.parent_id,
        depth,
        record.kind,
        pack_ints(record.token_ids),
        None if record.logprobs is None else pack_floats(record.logprobs),
        None if record.weight_versions is None else pack_ints(record.weight_versions),
        pack_mask(record.loss_mask or ()),
        record.text,
        record.reward,
        record.finish_reason,
        dict(record.timings),
        created_at,
    )


class WrittenTurn(NamedTuple):
    """A turn as it was written, kept in memory by the process that wrote it: where it
    sits (for its children's writes) and the columns of a trajectory's path
    (`turn_sql.TRAJECTORY_COLUMNS`, for a lease), packed exactly as stored."""

    id: uuid.UUID
    episode_id: uuid.UUID
    parent_id: uuid.UUID | None
    depth: int
    token_ids: bytes
    logprobs: bytes | None
    weight_versions: bytes | None
    loss_mask: bytes
    reward: float | None


_WRITTEN_FIELDS = operator.itemgetter(*(TURN_ROW_COLUMNS.index(f) for f in WrittenTurn._fields))


def written_turn(values: Sequence[Any]) -> WrittenTurn:
    """The `WrittenTurn` of a row's `turn_values`."""
    return WrittenTurn._make(_WRITTEN_FIELDS(values))


def stored_turn(row: Any, images: Mapping[uuid.UUID, tuple[str, ...]] | None = None) -> StoredTurn:
    """The turn of `row`, with its blob ids when `images` (turn id → ids) is given."""
    return StoredTurn(
        id=row.id,
        episode_id=row.episode_id,
        parent_id=row.parent_id,
        depth=row.depth,
        kind=cast(TurnKind, row.kind),
        token_ids=tuple(unpack_ints(row.token_ids)),
        logprobs=None if row.logprobs is None else tuple(unpack_floats(row.logprobs)),
        weight_versions=(
            None if row.weight_versions is None else tuple(unpack_ints(row.weight_versions))
        ),
        loss_mask=tuple(unpack_mask(row.loss_mask)),
        text=row.text,
        reward=row.reward,
        finish_reason=row.finish_reason,
        timings=dict(row.timings or {}),
        created_at=aware(row.created_at),
        images=images.get(row.id, ()) if images else (),
    )


def context_from_path(rows: Sequence[Any]) -> Context:
    """Concatenate the segments of `rows` (root first) into one `Context`."""
    tokens, logprobs, versions, masks = [], [], [], []
    starts: list[int] = []
    offset = 0
    for row in rows:
        data = bytes(row.token_ids)
        n = len(data) // _INT32.itemsize
        starts.append(offset)
        offset += n
        tokens.append(data)
        logprobs.append(_NO_LOGPROB * n if row.logprobs is None else bytes(row.logprobs))
        packed = row.weight_versions
        versions.append(_NO_VERSION * n if packed is None else bytes(packed))
        masks.append(bytes(row.loss_mask))
    return Context(
        turn_ids=tuple(row.id for row in rows),
        turn_starts=tuple(starts),
        token_ids=tuple(np.frombuffer(b"".join(tokens), dtype=_INT32).tolist()),
        logprobs=tuple(np.frombuffer(b"".join(logprobs), dtype=_FLOAT32).tolist()),
        loss_mask=tuple(unpack_mask(b"".join(masks))),
        weight_versions=tuple(np.frombuffer(b"".join(versions), dtype=_INT32).tolist()),
    )


def min_version(packed: bytes | None) -> int | None:
    """The smallest weight version in one turn's packed versions (None for no policy tokens)."""
    if not packed:
        return None
    return min(int_view(packed))


def version_range(packed: Iterable[bytes | None]) -> tuple[int, int] | None:
    """The oldest and newest weight version over turns' packed versions (None: no
    policy tokens at all)."""
    lows, highs = [], []
    for p in packed:
        if p:
            versions = int_view(p)
            lows.append(min(versions))
            highs.append(max(versions))
    if not lows:
        return None
    return min(lows), max(highs)


def trajectory_rows(
    tree: Sequence[Any],
    *,
    episode_id: uuid.UUID,
    run_id: uuid.UUID | None,
    leaf_turn_ids: Sequence[uuid.UUID] | None,
    leaf_rewards: Mapping[uuid.UUID, float],
    reward: float | None,
    created_at: datetime,
) -> list[dict[str, Any]]:
    """Trajectory rows for a finished episode whose turns (`id`, `parent_id`,
    `weight_versions`, parents first) are `tree`: one per chosen leaf (default: every
    leaf), each with the oldest weight version on its path."""
    if not tree:
        raise InvalidInput(
            f"episode {episode_id} has no turns to make a trajectory of", field="status"
        )
    path_min: dict[uuid.UUID, int | None] = {}
    for row in tree:  # parents first, so each path's minimum folds downwards
        own = min_version(row.weight_versions)
        above = None if row.parent_id is None else path_min[row.parent_id]
        path_min[row.id] = min((v for v in (own, above) if v is not None), default=None)
    if leaf_turn_ids is None:
        parents = {row.parent_id for row in tree}
        leaves = [row.id for row in tree if row.id not in parents]
    else:
        leaves = list(leaf_turn_ids)
        strangers = [leaf for leaf in leaves if leaf not in path_min]
        if strangers:
            raise InvalidInput(
                f"turn {strangers[0]} is not a turn of episode {episode_id}", field="leaf_turn_ids"
            )
    unknown = [leaf for leaf in leaf_rewards if leaf not in set(leaves)]
    if unknown:
        raise InvalidInput(
            f"leaf_rewards names {unknown[0]}, not a chosen leaf", field="leaf_rewards"
        )
    return [
        {
            "id": ids.new_id(),
            "run_id": run_id,
            "episode_id": episode_id,
            "leaf_turn_id": leaf,
            "reward": leaf_rewards.get(leaf, reward),
            "status": "ready",
            "lease_until": None,
            "times_served": 0,
            "min_weight_version": path_min[leaf],
            # Distinct timestamps keep the trajectories of one episode in leaf order.
            "created_at": created_at + timedelta(microseconds=index),
        }
        for index, leaf in enumerate(leaves)
    ]


def episode_info(row: Any) -> EpisodeInfo:
    return EpisodeInfo(**episode_fields(row))


def episode_fields(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "run_id": row.run_id,
        "environment_id": row.environment_id,
        "env_ref": row.env_ref,
        "task": dict(row.task or {}),
        "group_id": row.group_id,
        "status": cast(EpisodeStatus, row.status),
        "reward": row.reward,
        "error": row.error,
        "created_at": aware(row.created_at),
        "finished_at": None if row.finished_at is None else aware(row.finished_at),
        "min_weight_version": row.min_weight_version,
        "max_weight_version": row.max_weight_version,
    }


def trajectory_ref(row: Any) -> TrajectoryRef:
    return TrajectoryRef(
        id=row.id,
        leaf_turn_id=row.leaf_turn_id,
        reward=row.reward,
        status=cast(TrajectoryStatus, row.status),
        min_weight_version=row.min_weight_version,
    )


def ids_in_order(ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """`ids` without repeats, first occurrence kept."""
    return list(dict.fromkeys(ids))
