"""the trainer step whose metrics a weight version holds

`weight_versions.step` is the trainer step whose metrics are stored with the version (null
while it has none, and for versions recorded before this revision). A step recorded
again at a newer version (a trainer that resumed from a checkpoint does the steps after
it again) clears the older version's metrics, so a run has one row per step.

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("weight_versions", sa.Column("step", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("weight_versions", "step")  # SQLite 3.35+ drops columns itself
