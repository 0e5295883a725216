"""Blobs: content ids, the file store's dedupe and atomic writes, the store choice,
image checks on turn records and data URLs."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path

import pytest

from agentflow.config import Settings
from agentflow.db.blobs import DatabaseBlobStore, FileBlobStore, NewBlob, blob_store_for
from agentflow.errors import InvalidInput
from agentflow.images import blob_id, data_url, image_media_type, is_blob_id, parse_data_url
from agentflow.types import TurnRecord

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
JPEG = b"\xff\xd8\xff\xe0" + b"\x01" * 32


def test_ids_are_sha256_hex_and_checked() -> None:
    assert blob_id(PNG) == hashlib.sha256(PNG).hexdigest()
    assert is_blob_id(blob_id(PNG))
    for bad in ("", "ab", blob_id(PNG).upper(), blob_id(PNG)[:-1] + "g", blob_id(PNG) + "0", 7):
        assert not is_blob_id(bad)


def test_media_types_by_signature_only() -> None:
    assert image_media_type(PNG) == "image/png"
    assert image_media_type(JPEG) == "image/jpeg"
    assert image_media_type(b"GIF89a....") is None
    blob = NewBlob.of(JPEG)
    assert (blob.sha256, blob.media_type) == (blob_id(JPEG), "image/jpeg")
    with pytest.raises(InvalidInput):
        NewBlob.of(b"<svg/>")


async def test_file_store_writes_once_under_the_hash(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    sha = blob_id(PNG)
    await store.put([NewBlob.of(PNG)], None)  # type: ignore[arg-type]  # files need no connection
    path = tmp_path / sha[:2] / sha[2:]
    assert path.read_bytes() == PNG
    first = path.stat().st_mtime_ns
    os.utime(path, ns=(1, 1))
    store.write(sha, PNG)  # already there: not rewritten
    assert path.stat().st_mtime_ns == 1 != first
    assert await store.get(sha, None) == PNG  # type: ignore[arg-type]
    assert await store.get(blob_id(JPEG), None) is None  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [sha[2:]]  # no temp left


def test_file_store_writes_are_atomic_and_concurrent_writers_agree(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    data = PNG + os.urandom(1 << 20)
    sha = blob_id(data)
    seen: list[bytes] = []
    stop = threading.Event()

    def reader() -> None:  # a reader sees nothing or all of it, never part
        while not stop.is_set():
            try:
                seen.append(store.path(sha).read_bytes())
            except FileNotFoundError:
                pass

    threads = [threading.Thread(target=reader)]
    threads += [threading.Thread(target=store.write, args=(sha, data)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert store.path(sha).read_bytes() == data
    assert all(s == data for s in seen)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [store.path(sha)]


def test_failed_write_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileBlobStore(tmp_path)

    def broken(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        store.write(blob_id(PNG), PNG)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_store_choice_from_settings(tmp_path: Path) -> None:
    sqlite = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    pg = "postgresql+asyncpg://postgres@127.0.0.1/x"
    auto = blob_store_for(Settings(database_url=sqlite))
    assert isinstance(auto, FileBlobStore) and auto.root == tmp_path / "a.db-blobs"
    assert isinstance(blob_store_for(Settings(database_url=pg)), DatabaseBlobStore)
    chosen = blob_store_for(Settings(database_url=pg, blob_store="file", blob_dir=str(tmp_path)))
    assert isinstance(chosen, FileBlobStore) and chosen.root == tmp_path
    assert isinstance(
        blob_store_for(Settings(database_url=sqlite, blob_store="database")), DatabaseBlobStore
    )
    with pytest.raises(ValueError, match="BLOB_DIR"):
        blob_store_for(Settings(database_url=pg, blob_store="file"))
    with pytest.raises(ValueError):
        Settings(database_url=pg, blob_store="s3")  # type: ignore[arg-type]


def test_turn_records_check_their_images() -> None:
    ref = blob_id(JPEG)
    record = TurnRecord(kind="env", token_ids=(1,), images=[PNG, bytearray(JPEG), ref])  # type: ignore[arg-type]
    assert record.images == (PNG, JPEG, ref)
    for images, where in [
        ((b"not an image",), ("images", "0")),
        ((PNG, "not-a-hash"), ("images", "1")),
    ]:
        with pytest.raises(InvalidInput) as caught:
            TurnRecord(kind="env", token_ids=(1,), images=images)
        assert caught.value.field == where
    with pytest.raises(InvalidInput, match="policy"):
        TurnRecord(
            kind="policy", token_ids=(1,), logprobs=(0.0,), weight_versions=(0,), images=(PNG,)
        )


def test_data_urls() -> None:
    where = ("messages", "0")
    assert parse_data_url(data_url(PNG), max_bytes=1000, field=where) == PNG
    jpeg = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    assert parse_data_url(jpeg, max_bytes=1000, field=where) == JPEG
    b64 = base64.b64encode(PNG).decode()
    for url, reason in [
        ("https://example.com/cat.png", "not fetched"),
        ("http://10.0.0.1/x.png", "not fetched"),
        ("file:///etc/passwd", "data URL"),
        (f"data:image/gif;base64,{b64}", "PNG or JPEG"),
        (f"data:image/jpeg;base64,{b64}", "not a image/jpeg"),
        ("data:image/png;base64,!!!!", "malformed"),
        (f"data:image/png,{b64}", "data URL"),
        (data_url(PNG + b"\x00" * 2000), "larger than"),
    ]:
        with pytest.raises(InvalidInput, match=reason) as caught:
            parse_data_url(url, max_bytes=1000, field=where)
        assert caught.value.field == where
