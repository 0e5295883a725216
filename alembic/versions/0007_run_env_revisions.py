"""a run's env mix in revisions

`runs.env_revision` is the revision of the mix a run's config holds (0 as created); each
change made to a live run's mix (`PATCH /v1/runs/{id}`) is a row of `run_env_revisions`
with the weight version the run served when it took effect. Runs created before this
revision have no rows: their first change stores the mix they were created with as
revision 0.

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("env_revision", sa.Integer(), server_default="0", nullable=False)
        )
    op.create_table(
        "run_env_revisions",
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("envs", sa.JSON(), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column("changed_by", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_run_env_revisions_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "revision", name=op.f("pk_run_env_revisions")),
    )


def downgrade() -> None:
    op.drop_table("run_env_revisions")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("env_revision")
