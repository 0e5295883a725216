"""episode weight versions, and the index the dashboard's episode pages read by

`episodes.min_weight_version` and `max_weight_version` are the oldest and newest weight
versions any of the episode's tokens was sampled with (set when it finishes; null for an
episode with no policy tokens), so episodes can be filtered by version without reading
their turns. `ix_episodes_run_id_created_at` serves a run's episodes in creation order a
page at a time. Finished episodes of older schemas are filled in from their turns.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN on both databases: a batch (copy-and-rename) table on SQLite
    # would break the trigger on `turns` that reads `episodes` (0002).
    op.add_column("episodes", sa.Column("min_weight_version", sa.Integer(), nullable=True))
    op.add_column("episodes", sa.Column("max_weight_version", sa.Integer(), nullable=True))
    op.create_index("ix_episodes_run_id_created_at", "episodes", ["run_id", "created_at"])
    _fill_in_versions()


def _fill_in_versions() -> None:
    """Each finished episode's version range from its turns' packed versions (int32 LE),
    read in one streamed pass."""
    bind = op.get_bind()
    turns = sa.table(
        "turns",
        sa.column("episode_id", sa.Uuid()),
        sa.column("weight_versions", sa.LargeBinary()),
    )
    ranges: dict[object, tuple[int, int]] = {}
    rows = bind.execute(
        sa.select(turns.c.episode_id, turns.c.weight_versions).where(
            turns.c.weight_versions.is_not(None)
        ),
        execution_options={"yield_per": 2000},  # this statement's only, not the connection's
    )
    for episode_id, packed in rows:
        if not packed:
            continue
        versions = np.frombuffer(packed, dtype="<i4")
        low, high = int(versions.min()), int(versions.max())
        if episode_id in ranges:
            old_low, old_high = ranges[episode_id]
            low, high = min(low, old_low), max(high, old_high)
        ranges[episode_id] = (low, high)
    if not ranges:
        return
    episodes = sa.table(
        "episodes",
        sa.column("id", sa.Uuid()),
        sa.column("min_weight_version", sa.Integer()),
        sa.column("max_weight_version", sa.Integer()),
    )
    bind.execute(
        episodes.update()
        .where(episodes.c.id == sa.bindparam("episode"))
        .values(
            min_weight_version=sa.bindparam("low"), max_weight_version=sa.bindparam("high")
        ),
        [{"episode": e, "low": low, "high": high} for e, (low, high) in ranges.items()],
    )


def downgrade() -> None:
    op.drop_index("ix_episodes_run_id_created_at", table_name="episodes")
    op.drop_column("episodes", "max_weight_version")  # SQLite 3.35+ drops columns itself
    op.drop_column("episodes", "min_weight_version")
