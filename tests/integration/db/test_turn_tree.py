"""TurnTree rules on both databases: tree checks, atomic batches, atomic completion."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db.models import Trajectory, Turn
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict, InvalidInput, NotFound
from agentflow.types import NewTurn, TurnRecord

pytestmark = pytest.mark.integration


def prompt(*tokens: int) -> TurnRecord:
    return TurnRecord(kind="prompt", token_ids=tokens or (1, 2, 3))


def answer(version: int, *tokens: int) -> TurnRecord:
    tokens = tokens or (7, 8)
    return TurnRecord(
        kind="policy",
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        weight_versions=[version] * len(tokens),
        finish_reason="stop",
    )


def observation(*tokens: int) -> TurnRecord:
    return TurnRecord(kind="env", token_ids=tokens or (4,), text="obs")


async def test_episodes_are_validated(turn_tree: TurnTree) -> None:
    with pytest.raises(NotFound, match="run"):
        await turn_tree.create_episode(run_id=uuid.uuid4())
    with pytest.raises(NotFound, match="environment"):
        await turn_tree.create_episode(environment_id=uuid.uuid4())
    with pytest.raises(InvalidInput) as info:
        await turn_tree.create_episode(task={"x": float("nan")})
    assert info.value.field == ("task",)
    with pytest.raises(InvalidInput) as info:
        await turn_tree.create_episode(group_id="g" * 65)
    assert info.value.field == ("group_id",)
    with pytest.raises(InvalidInput):
        await turn_tree.create_episode(status="completed")  # type: ignore[arg-type]
    episode = await turn_tree.create_episode(env_ref="guess-number@1", status="pending")
    assert (await turn_tree.episode(episode)).env_ref == "guess-number@1"
    with pytest.raises(Conflict):
        await turn_tree.create_episode(episode_id=episode)
    with pytest.raises(InvalidInput) as info:
        await turn_tree.complete_episode(episode, "failed", error="bad\x00byte")
    assert info.value.field == ("error",)


async def test_parents_must_exist_and_share_the_episode(turn_tree: TurnTree) -> None:
    first = await turn_tree.create_episode()
    second = await turn_tree.create_episode()
    root = await turn_tree.add_turn(first, None, prompt())
    with pytest.raises(InvalidInput) as info:
        await turn_tree.add_turn(second, root, answer(0))
    assert info.value.field == ("turns", "0", "parent_id")
    with pytest.raises(NotFound, match="parent turn"):
        await turn_tree.add_turn(first, uuid.uuid4(), answer(0))
    with pytest.raises(NotFound, match="episode"):
        await turn_tree.add_turn(uuid.uuid4(), None, prompt())
    with pytest.raises(Conflict, match="already used"):
        await turn_tree.add_turn(first, None, prompt(), turn_id=root)
    assert [t.id for t in await turn_tree.leaves(first)] == [root]
    assert await turn_tree.leaves(second) == []


async def test_a_bad_batch_writes_nothing(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode()
    root = NewTurn(episode_id=episode, parent_id=None, record=prompt())
    child = NewTurn(episode_id=episode, parent_id=root.id, record=answer(1))
    with pytest.raises(InvalidInput, match="comes after its child"):
        await turn_tree.add_turns([child, root])
    stranger = NewTurn(episode_id=episode, parent_id=uuid.uuid4(), record=answer(1))
    with pytest.raises(NotFound):
        await turn_tree.add_turns([root, child, stranger])
    with pytest.raises(InvalidInput, match="twice"):
        await turn_tree.add_turns([root, root])
    assert (await turn_tree.episode_tree(episode)).roots == ()
    assert await turn_tree.add_turns([root, child]) == [root.id, child.id]
    assert [t.depth for t in await turn_tree.path(child.id)] == [0, 1]


async def test_branches_share_their_prefix(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode(task={"q": "guess"}, group_id="g1")
    root = await turn_tree.add_turn(episode, None, prompt(1, 2))
    samples = [await turn_tree.add_turn(episode, root, answer(v, 10 + v)) for v in range(3)]
    assert [t.id for t in await turn_tree.children(root)] == samples
    for version, sample in enumerate(samples):
        context = await turn_tree.context(sample)
        assert context.token_ids == (1, 2, 10 + version)
        assert context.weight_versions == (-1, -1, version)
        assert context.loss_mask == (0, 0, 1)
        assert context.turn_starts == (0, 2)
    tree = await turn_tree.episode_tree(episode)
    assert tree.task == {"q": "guess"} and tree.group_id == "g1" and tree.status == "running"
    assert [node.id for node in tree.roots] == [root]
    assert [node.id for node in tree.roots[0].children] == samples
    with pytest.raises(NotFound):
        await turn_tree.context(uuid.uuid4())
    with pytest.raises(NotFound):
        await turn_tree.children(uuid.uuid4())
    with pytest.raises(NotFound):
        await turn_tree.episode_tree(uuid.uuid4())


async def test_completion_makes_one_trajectory_per_leaf(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode(group_id="g2")
    root = await turn_tree.add_turn(episode, None, prompt())
    old = await turn_tree.add_turn(episode, root, answer(3))
    new = await turn_tree.add_turn(episode, root, answer(5))
    final = NewTurn(episode_id=episode, parent_id=old, record=observation(9))
    ids = await turn_tree.complete_episode(
        episode, "completed", reward=1.0, leaf_rewards={new: 0.25}, turns=[final]
    )
    trajectories = {t.leaf_turn_id: t for t in await turn_tree.trajectories(ids)}
    assert set(trajectories) == {final.id, new}
    assert trajectories[final.id].token_ids == (1, 2, 3, 7, 8, 9)
    assert trajectories[final.id].min_weight_version == 3
    assert trajectories[final.id].reward == 1.0
    assert trajectories[final.id].staleness(current_version=5) == 2
    assert trajectories[new].min_weight_version == 5 and trajectories[new].reward == 0.25
    one = await turn_tree.trajectory(ids[0])
    assert one.status == "ready" and one.times_served == 0 and one.group_id == "g2"

    tree = await turn_tree.episode_tree(episode)
    assert tree.status == "completed" and tree.reward == 1.0 and tree.finished_at is not None
    assert {t.id for t in tree.trajectories} == set(ids)

    with pytest.raises(Conflict, match="already completed"):
        await turn_tree.complete_episode(episode, "completed", reward=0.0)
    with pytest.raises(Conflict, match="no more turns"):
        await turn_tree.add_turn(episode, new, observation())
    with pytest.raises(NotFound):
        await turn_tree.trajectory(uuid.uuid4())


async def test_a_long_batch_lands_whole_and_a_finished_episode_refuses_it(
    turn_tree: TurnTree,
) -> None:
    # Hundreds of rows, as a saturated controller's group commit writes them.
    episode = await turn_tree.create_episode()
    batch, parent = [], None
    for n in range(150):
        record = answer(n, n, n + 1) if n % 2 else observation(n)
        turn = NewTurn(episode_id=episode, parent_id=parent, record=record)
        batch.append(turn)
        parent = turn.id
    assert await turn_tree.add_turns(batch) == [t.id for t in batch]
    path = await turn_tree.path(batch[-1].id)
    assert [t.token_ids for t in path] == [t.record.token_ids for t in batch]
    assert list(path[-1].logprobs or ()) == [-0.5, -0.5]
    assert list(path[-1].weight_versions or ()) == [149, 149]

    await turn_tree.complete_episode(episode, "completed", 1.0)
    more, parent = [], batch[-1].id
    for n in range(100):
        more.append(NewTurn(episode_id=episode, parent_id=parent, record=observation(n)))
        parent = more[-1].id
    with pytest.raises(Conflict, match="no more turns"):
        await turn_tree.add_turns(more)
    assert len(await turn_tree.path(batch[-1].id)) == 150


async def test_chosen_leaves_and_untrainable_endings(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode()
    root = await turn_tree.add_turn(episode, None, prompt())
    mid = await turn_tree.add_turn(episode, root, answer(2))
    await turn_tree.add_turn(episode, mid, observation())
    ids = await turn_tree.complete_episode(episode, "truncated", 0.0, leaf_turn_ids=[mid])
    assert [t.leaf_turn_id for t in await turn_tree.trajectories(ids)] == [mid]

    failed = await turn_tree.create_episode()
    await turn_tree.add_turn(failed, None, prompt())
    assert await turn_tree.complete_episode(failed, "failed", error="env crashed") == []
    tree = await turn_tree.episode_tree(failed)
    assert tree.status == "failed" and tree.error == "env crashed" and tree.trajectories == ()
    with pytest.raises(InvalidInput):
        await turn_tree.complete_episode(failed, "running")  # type: ignore[arg-type]


async def test_a_failed_completion_changes_nothing(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode()
    other = await turn_tree.create_episode()
    root = await turn_tree.add_turn(episode, None, prompt())
    foreign = await turn_tree.add_turn(other, None, prompt())
    final = NewTurn(episode_id=episode, parent_id=root, record=observation())
    # The status update and the final turn are written before the leaf check fails.
    with pytest.raises(InvalidInput, match="not a turn of episode"):
        await turn_tree.complete_episode(
            episode, "completed", 1.0, leaf_turn_ids=[foreign], turns=[final]
        )
    tree = await turn_tree.episode_tree(episode)
    assert tree.status == "running" and tree.finished_at is None and tree.trajectories == ()
    assert [node.id for node in tree.roots] == [root] and tree.roots[0].children == ()
    empty = await turn_tree.create_episode()
    with pytest.raises(InvalidInput, match="no turns"):
        await turn_tree.complete_episode(empty, "completed", 1.0)
    assert (await turn_tree.episode(empty)).status == "running"
    with pytest.raises(NotFound):
        await turn_tree.complete_episode(uuid.uuid4(), "completed", 1.0)


async def test_concurrent_ends_share_a_commit_and_each_keeps_its_own_error(
    turn_tree: TurnTree,
) -> None:
    """Ends that queue together are one group commit: the good ones are written with
    their versions and trajectories; an episode finished already, a missing one, an
    empty one and one naming a stranger's leaf each fail alone, and the last one's final
    turn is not written."""
    good, roots = [], {}
    for version in range(7):
        episode = await turn_tree.create_episode()
        roots[episode] = await turn_tree.add_turn(episode, None, prompt())
        await turn_tree.add_turn(episode, roots[episode], answer(version))
        good.append(episode)
    finished = good.pop()
    await turn_tree.complete_episode(finished, "completed", 0.0)
    empty = await turn_tree.create_episode()
    wrong, neighbour = good.pop(), good.pop()
    final = NewTurn(episode_id=wrong, parent_id=roots[wrong], record=observation())
    calls = [
        *(turn_tree.complete_episode(e, "completed", float(i)) for i, e in enumerate(good)),
        turn_tree.complete_episode(finished, "completed", 1.0),
        turn_tree.complete_episode(uuid.uuid4(), "failed"),
        turn_tree.complete_episode(empty, "completed", 1.0),
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["list"] * len(good) + [
        "Conflict",
        "NotFound",
        "InvalidInput",
    ]
    # A failed end with final turns rolls its batch back; the batch is written again one
    # end at a time, so its neighbour still ends.
    last = await asyncio.gather(
        turn_tree.complete_episode(
            wrong, "completed", 1.0, leaf_turn_ids=[roots[good[0]]], turns=[final]
        ),
        turn_tree.complete_episode(neighbour, "completed", 5.0),
        return_exceptions=True,
    )
    assert isinstance(last[0], InvalidInput) and isinstance(last[1], list)
    assert (await turn_tree.episode(neighbour)).status == "completed"
    for index, episode in enumerate(good):
        tree = await turn_tree.episode_tree(episode)
        assert tree.status == "completed" and tree.reward == float(index)
        assert tree.min_weight_version == tree.max_weight_version == index
        assert [t.id for t in tree.trajectories] == results[index]
    assert (await turn_tree.episode(finished)).reward == 0.0
    assert (await turn_tree.episode(empty)).status == "running"
    wrong_tree = await turn_tree.episode_tree(wrong)
    assert wrong_tree.status == "running" and len(wrong_tree.roots[0].children) == 1


async def test_racing_completions_make_one_set_of_trajectories(turn_tree: TurnTree) -> None:
    episode = await turn_tree.create_episode()
    root = await turn_tree.add_turn(episode, None, prompt())
    await turn_tree.add_turn(episode, root, answer(1))
    results = await asyncio.gather(
        *(turn_tree.complete_episode(episode, "completed", float(i)) for i in range(4)),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, list)]
    assert len(winners) == 1 and len(winners[0]) == 1
    assert all(isinstance(r, Conflict) for r in results if not isinstance(r, list))
    tree = await turn_tree.episode_tree(episode)
    assert [t.id for t in tree.trajectories] == winners[0]


async def test_turns_racing_a_completion_are_either_refused_or_trajectories(
    turn_tree: TurnTree,
) -> None:
    episode = await turn_tree.create_episode()
    root = await turn_tree.add_turn(episode, None, prompt())

    async def add(version: int) -> uuid.UUID:
        await asyncio.sleep(0.001 * version)
        return await turn_tree.add_turn(episode, root, answer(version))

    async def complete() -> list[uuid.UUID]:
        await asyncio.sleep(0.006)  # land among the adds, so some get in and some do not
        return await turn_tree.complete_episode(episode, "completed", 1.0)

    *added, completed = await asyncio.gather(
        *(add(v) for v in range(12)), complete(), return_exceptions=True
    )
    assert isinstance(completed, list)
    written = {turn_id for turn_id in added if isinstance(turn_id, uuid.UUID)}
    assert all(isinstance(r, Conflict) for r in added if not isinstance(r, uuid.UUID))
    leaves = {t.leaf_turn_id for t in await turn_tree.trajectories(completed)}
    # A turn that got in became a leaf before the completion read the tree; with no
    # turn in, the root itself is the one leaf.
    assert leaves == (written or {root})


async def test_no_trajectory_points_at_a_missing_turn(
    turn_tree: TurnTree, db_engine: AsyncEngine
) -> None:
    """Checked across everything written to this database, this test's episode included."""
    episode = await turn_tree.create_episode()
    root = await turn_tree.add_turn(episode, None, prompt())
    for version in range(3):
        await turn_tree.add_turn(episode, root, answer(version))
    assert len(await turn_tree.complete_episode(episode, "completed", 1.0)) == 3
    async with db_engine.connect() as conn:
        dangling = await conn.scalars(
            select(Trajectory.id)
            .outerjoin(Turn, Turn.id == Trajectory.leaf_turn_id)
            .where(Turn.id.is_(None))
        )
        assert list(dangling) == []
        all_ids = list(await conn.scalars(select(Trajectory.id)))
    assert len(all_ids) >= 3
    for trajectory in await turn_tree.trajectories(all_ids):
        path = await turn_tree.path(trajectory.leaf_turn_id)
        assert path[0].parent_id is None  # the whole way up to a root is there
        assert tuple(t.id for t in path) == trajectory.turn_ids
        assert len(trajectory.token_ids) == sum(len(t.token_ids) for t in path)


async def test_a_lease_builds_the_paths_this_process_wrote_from_memory(
    turn_tree: TurnTree, db_engine: AsyncEngine
) -> None:
    """Trajectories whose turns this `TurnTree` wrote are built without reading their
    turns back, equal to what the database holds; once served they are read again like
    any other. A path with a turn written elsewhere is read whole."""
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    elsewhere = TurnTree(turn_tree.sessions)  # another process's writer
    episode = await turn_tree.create_episode(group_id="kept")
    shared = await elsewhere.create_episode(group_id="shared")
    ids = []
    for ep, first in ((episode, turn_tree), (shared, elsewhere)):
        root = await first.add_turn(ep, None, prompt(1, 2))
        reply = await turn_tree.add_turn(ep, root, answer(4, 7, 8))
        env = TurnRecord(kind="env", token_ids=(9,), text="obs", reward=0.5)
        await turn_tree.add_turns([NewTurn(episode_id=ep, parent_id=reply, record=env)])
        await turn_tree.add_turn(ep, root, answer(5, 6))  # a second branch
        ids += await turn_tree.complete_episode(ep, "completed", reward=1.0)
    reader = TurnTree(turn_tree.sessions)  # keeps nothing: reads every path
    stored = await reader.trajectories(ids)

    event.listen(db_engine.sync_engine, "before_cursor_execute", count)
    try:
        kept = await turn_tree.trajectories(ids[:2])
        assert len(statements) == 1  # the trajectory rows; no turns read
        assert kept == stored[:2]
        assert kept[0].turn_rewards in {(0.0, 0.0, 0.5), (0.0, 0.0)}
        statements.clear()
        assert await turn_tree.trajectories(ids) == stored  # served: read again
        assert len(statements) == 2  # the trajectory rows, then the episodes' turns
    finally:
        event.remove(db_engine.sync_engine, "before_cursor_execute", count)
    assert {t.token_ids for t in stored} == {(1, 2, 7, 8, 9), (1, 2, 6)}


async def test_unstorable_text_and_timings_round_trip_on_either_path(turn_tree: TurnTree) -> None:
    """A lone turn and a batch (on PostgreSQL the driver's own statement) store an env's
    unencodable text as U+FFFD and keep the timings."""
    episode = await turn_tree.create_episode()
    record = TurnRecord(kind="env", token_ids=(1,), text="x\ud800y", timings={"env": 0.25})
    root = await turn_tree.add_turn(episode, None, record)
    batch = [NewTurn(episode_id=episode, parent_id=root, record=record) for _ in range(2)]
    await turn_tree.add_turns(batch)
    for turn_id in (root, *(t.id for t in batch)):
        stored = await turn_tree.turn(turn_id)
        assert stored.text == "x\ufffdy" and stored.timings == {"env": 0.25}


async def test_an_episode_s_unstorable_task_and_error_are_stored_as_replacements(
    turn_tree: TurnTree,
) -> None:
    """Creates and ends (on PostgreSQL straight on the driver) make text storable as the
    column types do on the SQLAlchemy path."""
    episode = await turn_tree.create_episode(task={"k\ud800": ["a\udfffb", 1]}, group_id="g")
    await turn_tree.complete_episode(episode, "failed", error="boom \ud800")
    info = await turn_tree.episode(episode)
    assert info.task == {"k\ufffd": ["a\ufffdb", 1]} and info.group_id == "g"
    assert info.status == "failed" and info.error == "boom \ufffd" and info.finished_at
