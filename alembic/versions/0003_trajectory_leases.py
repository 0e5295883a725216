"""trajectory leases: the lease id of the latest lease and why a trajectory was rejected

`lease_id` identifies the trainer's lease so an acknowledgement counts once, even when it
arrives after the lease expired (a trainer that committed its step and then restarted);
`error` records why the trainer rejected a trajectory. Trajectory statuses gain `stale`
and `rejected` (the column is free text).

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("lease_id", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("error")
        batch.drop_column("lease_id")
