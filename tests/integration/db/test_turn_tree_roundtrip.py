"""Random branching turn trees round-trip exactly on PostgreSQL and SQLite.

Every node's reconstructed context (tokens, float32 log-probs, versions, mask) must equal
the concatenation of the segments written on its path, bit for bit; the tree, its
leaves and the trajectories made from it must match what was written.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentflow.db.turn_tree import TurnTree
from agentflow.types import NO_VERSION, NewTurn, TurnNode, TurnRecord

pytestmark = pytest.mark.integration

KINDS = ("prompt", "policy", "env", "tool")


@dataclass(frozen=True)
class PlannedTurn:
    parent: int | None  # index of an earlier turn, or None for a root
    record: TurnRecord


@st.composite
def turn_records(draw: st.DrawFn) -> TurnRecord:
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(0, 24))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    if kind != "policy":
        return TurnRecord(
            kind=kind,
            token_ids=tokens,
            # What the database can hold (agentflow.db.storable: NUL and lone surrogates
            # are refused over the API and stored as U+FFFD otherwise, tested there).
            text=draw(
                st.none()
                | st.text(
                    st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=8
                )
            ),
        )
    return TurnRecord(
        kind="policy",
        token_ids=tokens,
        # width=32: only values exactly representable in float32, as the store keeps them.
        logprobs=draw(
            st.lists(
                st.floats(width=32, max_value=0.0, allow_nan=False, allow_infinity=False),
                min_size=n,
                max_size=n,
            )
        ),
        weight_versions=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        reward=draw(st.none() | st.floats(-10, 10)),
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort"])),
        timings=draw(st.dictionaries(st.sampled_from(["queue", "generate"]), st.floats(0, 9))),
    )


@st.composite
def turn_trees(draw: st.DrawFn) -> tuple[list[PlannedTurn], list[int]]:
    """Turns in creation order (parents first), mostly one root with branches; and the
    sizes of the write batches that cover them (1 means `add_turn`)."""
    n = draw(st.integers(1, 12))
    turns = []
    for i in range(n):
        new_root = draw(st.integers(0, 9)) == 0  # an extra root now and then
        parent = None if i == 0 or new_root else draw(st.integers(0, i - 1))
        turns.append(PlannedTurn(parent=parent, record=draw(turn_records())))
    batches: list[int] = []
    while sum(batches) < n:
        batches.append(draw(st.integers(1, n - sum(batches))))
    return turns, batches


def expected_context(turns: list[PlannedTurn], index: int) -> dict[str, list]:
    path = []
    while index is not None:
        path.append(turns[index].record)
        index = turns[index].parent  # type: ignore[assignment]
    out: dict[str, list] = {"token_ids": [], "logprobs": [], "weight_versions": [], "loss_mask": []}
    for record in reversed(path):
        n = len(record.token_ids)
        out["token_ids"] += record.token_ids
        out["logprobs"] += record.logprobs if record.logprobs is not None else [0.0] * n
        versions = record.weight_versions
        out["weight_versions"] += versions if versions is not None else [NO_VERSION] * n
        out["loss_mask"] += record.loss_mask or ()
    return out


def flatten(nodes: tuple[TurnNode, ...]) -> dict[uuid.UUID, tuple[uuid.UUID | None, list]]:
    """id -> (parent id, child ids) over a forest, checking depths on the way."""
    seen: dict[uuid.UUID, tuple[uuid.UUID | None, list]] = {}
    stack = [(node, 0) for node in nodes]
    while stack:
        node, depth = stack.pop()
        assert node.depth == depth
        seen[node.id] = (node.parent_id, [child.id for child in node.children])
        stack.extend((child, depth + 1) for child in node.children)
    return seen


@settings(
    max_examples=25,
    deadline=None,
    # The engine fixture is shared by all examples on purpose: each example writes its
    # own episode, so examples never see each other's data.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tree=turn_trees())
async def test_random_branching_trees_round_trip_exactly(
    turn_tree: TurnTree, tree: tuple[list[PlannedTurn], list[int]]
) -> None:
    turns, batches = tree
    episode = await turn_tree.create_episode(group_id="prop")
    ids = [uuid.uuid4() for _ in turns]
    start = 0
    for size in batches:
        part = range(start, start + size)
        if size == 1:
            t = turns[start]
            parent = None if t.parent is None else ids[t.parent]
            assert (
                await turn_tree.add_turn(episode, parent, t.record, turn_id=ids[start])
                == ids[start]
            )
        else:
            batch = [
                NewTurn(
                    episode_id=episode,
                    parent_id=None if turns[i].parent is None else ids[turns[i].parent],
                    record=turns[i].record,
                    id=ids[i],
                )
                for i in part
            ]
            assert await turn_tree.add_turns(batch) == [ids[i] for i in part]
        start += size

    contexts = await turn_tree.contexts(ids)
    for index, context in enumerate(contexts):
        want = expected_context(turns, index)
        assert list(context.token_ids) == want["token_ids"]
        assert list(context.logprobs) == want["logprobs"]
        assert list(context.weight_versions) == want["weight_versions"]
        assert list(context.loss_mask) == want["loss_mask"]
        assert context.turn_ids[-1] == ids[index]
        path = await turn_tree.path(ids[index])
        assert [t.id for t in path] == list(context.turn_ids)
        assert path[-1].record() == turns[index].record
        assert [t.depth for t in path] == list(range(len(path)))

    children = {i: [j for j, t in enumerate(turns) if t.parent == i] for i in range(len(turns))}
    for index, turn_id in enumerate(ids):
        assert [t.id for t in await turn_tree.children(turn_id)] == [
            ids[j] for j in children[index]
        ]
    leaf_ids = {ids[i] for i in range(len(turns)) if not children[i]}
    assert {t.id for t in await turn_tree.leaves(episode)} == leaf_ids

    episode_tree = await turn_tree.episode_tree(episode)
    shape = flatten(episode_tree.roots)
    assert shape == {
        ids[i]: (None if t.parent is None else ids[t.parent], [ids[j] for j in children[i]])
        for i, t in enumerate(turns)
    }

    trajectory_ids = await turn_tree.complete_episode(episode, "completed", reward=1.0)
    trajectories = await turn_tree.trajectories(trajectory_ids)
    assert {t.leaf_turn_id for t in trajectories} == leaf_ids
    for trajectory in trajectories:
        want = expected_context(turns, ids.index(trajectory.leaf_turn_id))
        assert list(trajectory.token_ids) == want["token_ids"]
        assert list(trajectory.logprobs) == want["logprobs"]
        assert list(trajectory.weight_versions) == want["weight_versions"]
        assert list(trajectory.loss_mask) == want["loss_mask"]
        sampled = [v for v in want["weight_versions"] if v != NO_VERSION]
        assert trajectory.min_weight_version == (min(sampled) if sampled else None)
        assert trajectory.reward == 1.0 and trajectory.status == "ready"
        assert trajectory.episode_id == episode and trajectory.group_id == "prop"
