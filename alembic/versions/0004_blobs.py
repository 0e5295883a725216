"""blobs: images stored once by content hash, and the links from turns to them

`blobs` holds one row per distinct content (the id is its SHA-256 in hex) with its media
type and size; `blob_data` holds the bytes when the database is the blob store (the file
store keeps them in a directory instead); `turn_blobs` lists each turn's blobs in order.
Turn rows never hold image bytes.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("media_type", sa.String(length=100), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    op.create_table(
        "blob_data",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"],
            ["blobs.sha256"],
            name=op.f("fk_blob_data_sha256_blobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blob_data")),
    )
    op.create_table(
        "turn_blobs",
        sa.Column("turn_id", sa.Uuid(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"],
            ["blobs.sha256"],
            name=op.f("fk_turn_blobs_sha256_blobs"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["turn_id"],
            ["turns.id"],
            name=op.f("fk_turn_blobs_turn_id_turns"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("turn_id", "position", name=op.f("pk_turn_blobs")),
    )
    with op.batch_alter_table("turn_blobs") as batch:
        batch.create_index(batch.f("ix_turn_blobs_sha256"), ["sha256"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("turn_blobs") as batch:
        batch.drop_index(batch.f("ix_turn_blobs_sha256"))
    op.drop_table("turn_blobs")
    op.drop_table("blob_data")
    op.drop_table("blobs")
