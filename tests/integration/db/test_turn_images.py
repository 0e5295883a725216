"""Turn images on both databases and both blob stores: each distinct image stored once,
linked from its turns in order, read back with the turns and as bytes."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db.blobs import BlobStore, DatabaseBlobStore, FileBlobStore, blob_data, blobs
from agentflow.db.session import session_factory
from agentflow.db.turn_images import turn_blobs
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import NotFound
from agentflow.images import blob_id
from agentflow.types import NewTurn, TurnRecord

pytestmark = pytest.mark.integration


def png() -> bytes:
    """A distinct PNG-signed image per call (tests share the session's database)."""
    return b"\x89PNG\r\n\x1a\n" + os.urandom(256)


@pytest.fixture(params=["database", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    return DatabaseBlobStore() if request.param == "database" else FileBlobStore(tmp_path)


@pytest.fixture
def tree(db_engine: AsyncEngine, store: BlobStore) -> TurnTree:
    return TurnTree(session_factory(db_engine), blob_store=store)


async def _count(tree: TurnTree, table, shas: list[str]) -> int:  # type: ignore[no-untyped-def]
    async with tree.sessions() as session:
        query = select(func.count()).select_from(table).where(table.c.sha256.in_(shas))
        return int(await session.scalar(query) or 0)


async def test_images_are_stored_once_and_linked_in_order(tree: TurnTree, store: BlobStore) -> None:
    a, b = png(), png()
    episode = await tree.create_episode()
    prompt = await tree.add_turn(
        episode, None, TurnRecord(kind="prompt", token_ids=(1,), images=(a,))
    )
    policy = await tree.add_turn(
        episode,
        prompt,
        TurnRecord(kind="policy", token_ids=(2,), logprobs=(-0.1,), weight_versions=(0,)),
    )
    # One batch: the same image twice in one turn and again in the next; one by its id.
    first = NewTurn(
        episode_id=episode,
        parent_id=policy,
        record=TurnRecord(kind="env", token_ids=(3,), images=(b, a, b)),
    )
    second = NewTurn(
        episode_id=episode,
        parent_id=first.id,
        record=TurnRecord(kind="env", token_ids=(), images=(blob_id(b),)),
    )
    await tree.add_turns([first, second])

    shas = [blob_id(a), blob_id(b)]
    assert await _count(tree, blobs, shas) == 2
    assert await _count(tree, turn_blobs, shas) == 5
    in_table = await _count(tree, blob_data, shas)
    if isinstance(store, FileBlobStore):
        assert in_table == 0
        assert store.path(blob_id(a)).read_bytes() == a
    else:
        assert in_table == 2

    episode_tree = await tree.episode_tree(episode)
    root = episode_tree.roots[0]
    env = root.children[0].children[0]
    assert root.images == (blob_id(a),)
    assert root.children[0].images == ()
    assert env.images == (blob_id(b), blob_id(a), blob_id(b))
    assert env.children[0].images == (blob_id(b),)
    assert [t.images for t in await tree.path(second.id)][-2:] == [env.images, (blob_id(b),)]
    assert (await tree.turn(first.id)).images == env.images
    assert (await tree.children(policy))[0].images == env.images
    assert (await tree.leaves(episode))[0].images == (blob_id(b),)
    assert (await tree.turn(first.id)).record().images == env.images  # refs round-trip
    assert await tree.images_of([prompt, policy, first.id]) == {
        prompt: (blob_id(a),),
        first.id: env.images,
    }

    info, data = await tree.blob(blob_id(b))
    assert (info.media_type, info.size, data) == ("image/png", len(b), b)
    with pytest.raises(NotFound):
        await tree.blob(blob_id(b"never stored"))


async def test_final_turns_and_concurrent_writers_store_one_copy(tree: TurnTree) -> None:
    shared = png()
    episodes = [await tree.create_episode() for _ in range(6)]
    roots = await asyncio.gather(
        *(
            tree.add_turn(e, None, TurnRecord(kind="prompt", token_ids=(1,), images=(shared,)))
            for e in episodes
        )
    )
    assert await _count(tree, blobs, [blob_id(shared)]) == 1
    last = png()
    final = NewTurn(
        episode_id=episodes[0],
        parent_id=roots[0],
        record=TurnRecord(kind="env", token_ids=(9,), images=(last,)),
    )
    await tree.complete_episode(episodes[0], "completed", 1.0, turns=[final])
    assert (await tree.turn(final.id)).images == (blob_id(last),)
    assert (await tree.blob(blob_id(last)))[1] == last


async def test_an_unknown_blob_id_is_not_found_and_writes_nothing(tree: TurnTree) -> None:
    episode = await tree.create_episode()
    missing = blob_id(png())
    with pytest.raises(NotFound, match=missing):
        await tree.add_turn(
            episode, None, TurnRecord(kind="prompt", token_ids=(1,), images=(missing,))
        )
    assert (await tree.episode_tree(episode)).roots == ()
    # The turn id was not half-written: the same episode still takes a root.
    turn_id = uuid.uuid4()
    await tree.add_turn(episode, None, TurnRecord(kind="prompt", token_ids=(1,)), turn_id=turn_id)
    assert (await tree.turn(turn_id)).images == ()
