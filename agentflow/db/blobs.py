"""Blobs: bytes stored once by content (turn images), and where the bytes live.

A blob's id is the SHA-256 of its bytes (`agentflow.images.blob_id`), so the same
screenshot seen in a thousand steps is one blob, and a link can never point at other
bytes than it was made for. Every blob has a row in `blobs` (media type, size) on both
databases; the bytes themselves go to a `BlobStore`:

- `FileBlobStore`: one file per blob under a directory, `ab/cdef...` by id, written to a
  temporary name, fsynced and renamed, so a reader never sees a partial file and a
  rewrite of the same id is a no-op. The default beside a SQLite database: images would
  bloat the one database file every writer queues on.
- `DatabaseBlobStore`: the `blob_data` table, written in the same transaction as the
  turns that link to the blobs. The default on PostgreSQL, where several gateway
  processes (or hosts) share the database but not a disk.

`blob_store_for(settings)` picks one (docs/decisions.md, "Images as blobs"). Stores are
handed the write transaction's connection and use it or not; a file written for a
transaction that then fails is an orphan no row names, harmless and rewritten as-is.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from agentflow.config import Settings
from agentflow.db.models import Blob, BlobData
from agentflow.images import blob_id, check_image

blobs = cast(Table, Blob.__table__)
blob_data = cast(Table, BlobData.__table__)
Connection = AsyncSession | AsyncConnection


@dataclass(frozen=True, slots=True)
class NewBlob:
    """Bytes to store, with the id and media type they were checked to have."""

    sha256: str
    media_type: str
    data: bytes

    @classmethod
    def of(cls, data: bytes) -> NewBlob:
        return cls(sha256=blob_id(data), media_type=check_image(data), data=data)


@dataclass(frozen=True, slots=True)
class BlobInfo:
    sha256: str
    media_type: str
    size: int


class BlobStore(Protocol):
    """Where blob bytes live. `put` runs inside the transaction that writes the blobs'
    rows (before it commits) and `get` on a reading connection; each may ignore them."""

    name: str

    async def put(self, new: Sequence[NewBlob], conn: Connection) -> None: ...

    async def get(self, sha256: str, conn: Connection) -> bytes | None: ...


def insert_ignoring_duplicates(table: Table, conn: Connection) -> postgresql.Insert | sqlite.Insert:
    """An INSERT that skips rows whose key is taken: two writers of one blob both succeed."""
    dialect = conn.get_bind().dialect.name if isinstance(conn, AsyncSession) else conn.dialect.name
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(table).on_conflict_do_nothing()


class DatabaseBlobStore:
    name = "database"

    async def put(self, new: Sequence[NewBlob], conn: Connection) -> None:
        if new:
            rows = [{"sha256": b.sha256, "data": b.data} for b in new]
            await conn.execute(insert_ignoring_duplicates(blob_data, conn), rows)

    async def get(self, sha256: str, conn: Connection) -> bytes | None:
        data = await conn.scalar(select(blob_data.c.data).where(blob_data.c.sha256 == sha256))
        return None if data is None else bytes(data)


class FileBlobStore:
    name = "file"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256[2:]

    async def put(self, new: Sequence[NewBlob], conn: Connection) -> None:
        if new:
            await asyncio.to_thread(self._write_all, new)

    def _write_all(self, new: Sequence[NewBlob]) -> None:
        for blob in new:
            self.write(blob.sha256, blob.data)

    def write(self, sha256: str, data: bytes) -> Path:
        """Write one blob atomically (temporary file, fsync, rename); a no-op when there."""
        final = self.path(sha256)
        if final.exists():  # same name, same bytes: content addressing
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        return final

    async def get(self, sha256: str, conn: Connection) -> bytes | None:
        try:
            return await asyncio.to_thread(self.path(sha256).read_bytes)
        except FileNotFoundError:
            return None


def default_blob_dir(database_url: str) -> Path | None:
    """`<file>-blobs` beside a SQLite database file; None for other databases."""
    prefix = "sqlite+aiosqlite:///"
    if not database_url.startswith(prefix):
        return None
    location = database_url[len(prefix) :].split("?", 1)[0]
    if not location or location == ":memory:":
        return None
    path = Path(location)
    return path.with_name(path.name + "-blobs")


def blob_store_for(settings: Settings) -> BlobStore:
    """The store `settings` choose: `blob_store` = file | database | auto (a file store
    beside a SQLite file, the table otherwise)."""
    choice = settings.blob_store
    directory = Path(settings.blob_dir) if settings.blob_dir else None
    if choice == "auto":
        directory = directory or default_blob_dir(settings.database_url)
        choice = "file" if directory is not None else "database"
    if choice == "database":
        return DatabaseBlobStore()
    directory = directory or default_blob_dir(settings.database_url)
    if directory is None:
        raise ValueError("AGENTFLOW_BLOB_STORE=file needs AGENTFLOW_BLOB_DIR with this database")
    return FileBlobStore(directory)


async def stored_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    """Which of `ids` already have a row."""
    if not ids:
        return set()
    found = await conn.scalars(select(blobs.c.sha256).where(blobs.c.sha256.in_(list(ids))))
    return set(found)


async def save(conn: Connection, store: BlobStore, new: Sequence[NewBlob]) -> None:
    """Store `new` (distinct ids) once each, skipping ids the database already has;
    inside the caller's transaction, so a committed row always has its bytes."""
    missing = await stored_ids(conn, [b.sha256 for b in new])
    fresh = [b for b in new if b.sha256 not in missing]
    if not fresh:
        return
    rows = [{"sha256": b.sha256, "media_type": b.media_type, "size": len(b.data)} for b in fresh]
    await conn.execute(insert_ignoring_duplicates(blobs, conn), rows)
    await store.put(fresh, conn)  # rows first: `blob_data` refers to them


async def info(conn: Connection, sha256: str) -> BlobInfo | None:
    row = (await conn.execute(select(blobs).where(blobs.c.sha256 == sha256))).one_or_none()
    return None if row is None else BlobInfo(row.sha256, row.media_type, row.size)
