"""SQLAlchemy 2 models: the turn-tree data model of docs/architecture.md, "Data model".

Ids are UUIDs made by the client, so a whole batch of turns (parents included) can be
inserted in one statement without a round trip per row. Token arrays are packed
little-endian bytes (`agentflow.db.packing`) so SQLite and PostgreSQL hold the same bytes.
`Integer` is 32 bits on PostgreSQL (SQLite holds 64): an API field that reaches such a
column is an `agentflow.integers.Int32`, so both refuse a wider value alike.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from agentflow import ids
from agentflow.db.storable import StorableJSON, StorableText

# Stable constraint names make migrations reproducible on both databases.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on both databases (SQLite drops the zone on read)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.astimezone(UTC) if value is not None and value.tzinfo else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: StorableJSON, list[Any]: StorableJSON}


class Environment(Base):
    __tablename__ = "environments"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=ids.new_id)
    name: Mapped[str] = mapped_column(String(200), index=True)
    version: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(StorableJSON)
    tools: Mapped[list[Any]] = mapped_column(StorableJSON, default=list)
    max_concurrency: Mapped[int] = mapped_column(Integer)
    step_timeout_s: Mapped[float] = mapped_column(Float)
    description: Mapped[str] = mapped_column(StorableText, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=ids.new_id)
    name: Mapped[str] = mapped_column(String(200), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(StorableJSON)
    status: Mapped[str] = mapped_column(String(16), index=True, default="pending")
    weight_version: Mapped[int] = mapped_column(Integer, default=0)
    # The revision of the env mix `config["envs"]` holds (0: as created); each change is
    # a `RunEnvRevision`. Changed only where it still holds the revision the change saw.
    env_revision: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class RunEnvRevision(Base):
    """One revision of a run's env mix: the entries, the weight version the run served
    when it took effect (the groups admitted after it follow it), when, and who made it."""

    __tablename__ = "run_env_revisions"

    run_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    envs: Mapped[list[dict[str, Any]]] = mapped_column(StorableJSON)
    weight_version: Mapped[int] = mapped_column(Integer)
    changed_by: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class RunEnvironment(Base):
    """Which registered environments a run uses (so an env in use cannot be deleted)."""

    __tablename__ = "run_environments"

    run_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    environment_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("environments.id", ondelete="RESTRICT"), primary_key=True, index=True
    )


class Episode(Base):
    __tablename__ = "episodes"
    # A run's episodes a page at a time, in creation order (the dashboard, the API).
    __table_args__ = (Index("ix_episodes_run_id_created_at", "run_id", "created_at"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=ids.new_id)
    run_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True, index=True
    )
    environment_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("environments.id", ondelete="SET NULL"), nullable=True
    )
    env_ref: Mapped[str] = mapped_column(String(200), default="", doc="registry id or name")
    task: Mapped[dict[str, Any]] = mapped_column(StorableJSON, default=dict)
    group_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default="pending")
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    # The oldest and newest weight versions its tokens were sampled with, set when it
    # finishes (null: no policy tokens, or still live).
    min_weight_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_weight_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Turn(Base):
    __tablename__ = "turns"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=ids.new_id)
    episode_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("episodes.id", ondelete="CASCADE"), index=True
    )
    parent_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("turns.id", ondelete="CASCADE"), nullable=True, index=True
    )
    depth: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    weight_versions: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    loss_mask: Mapped[bytes] = mapped_column(LargeBinary)
    text: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    timings: Mapped[dict[str, Any]] = mapped_column(StorableJSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Blob(Base):
    """A stored image (or other bytes), once per content: the id is its SHA-256 in hex.

    The bytes live in the configured `BlobStore` (`agentflow.db.blobs`): a directory, or
    `BlobData` below. This row is what the API and the links see either way."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    media_type: Mapped[str] = mapped_column(String(100))
    size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class BlobData(Base):
    """The bytes of a blob, for the database blob store (PostgreSQL by default)."""

    __tablename__ = "blob_data"

    sha256: Mapped[str] = mapped_column(
        ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True
    )
    data: Mapped[bytes] = mapped_column(LargeBinary)


class TurnBlob(Base):
    """Which blobs a turn carries, in order (an env turn's screenshot, a chat request's
    images). A table rather than a JSON list on `turns` so that the database checks each
    link names a stored blob, and a blob's users can be found by index."""

    __tablename__ = "turn_blobs"

    turn_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("turns.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256", ondelete="RESTRICT"), index=True)


class Trajectory(Base):
    __tablename__ = "trajectories"
    __table_args__ = (Index("ix_trajectories_run_status", "run_id", "status"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=ids.new_id)
    run_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True
    )
    episode_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("episodes.id", ondelete="CASCADE"), index=True
    )
    leaf_turn_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"))
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="ready")
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The latest lease; kept after it expires so a trainer that committed a step with it
    # can still acknowledge it, and cleared by the acknowledgement (which makes a repeated
    # ack a no-op).
    lease_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    times_served: Mapped[int] = mapped_column(Integer, default=0)  # acknowledged trainings
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)  # why it was rejected
    min_weight_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WeightVersion(Base):
    __tablename__ = "weight_versions"

    run_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(StorableText, default="")
    metrics: Mapped[dict[str, Any]] = mapped_column(StorableJSON, default=dict)
    # The trainer step whose metrics these are (null: none recorded, or recorded without).
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
