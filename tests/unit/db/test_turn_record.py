"""Turn records validate themselves; rows convert to contexts and trajectories exactly."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from agentflow.db import packing, turn_rows
from agentflow.db.packing import pack_floats, pack_ints, pack_mask
from agentflow.errors import InvalidInput
from agentflow.types import NO_VERSION, NewTurn, TurnRecord


def policy(**overrides: Any) -> TurnRecord:
    fields: dict[str, Any] = {
        "kind": "policy",
        "token_ids": [5, 6, 7],
        "logprobs": [-0.5, -1.0, -0.25],
        "weight_versions": [3, 3, 4],
    }
    return TurnRecord(**(fields | overrides))


def test_policy_turn_is_normalized_to_tuples_with_a_full_loss_mask() -> None:
    record = policy()
    assert record.token_ids == (5, 6, 7)
    assert record.logprobs == (-0.5, -1.0, -0.25)
    assert record.weight_versions == (3, 3, 4)
    assert record.loss_mask == (1, 1, 1)


def test_other_turns_default_to_a_zero_mask_and_no_logprobs() -> None:
    record = TurnRecord(kind="env", token_ids=(1, 2))
    assert record.loss_mask == (0, 0)
    assert record.logprobs is None and record.weight_versions is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kind": "assistant"}, "kind"),
        ({"token_ids": [1, -2, 3]}, "token_ids"),
        ({"token_ids": [1, 2**31, 3]}, "token_ids"),
        ({"token_ids": [1.5, 2, 3]}, "token_ids"),
        ({"token_ids": [[1], [2], [3]]}, "token_ids"),
        ({"logprobs": None}, "logprobs"),
        ({"weight_versions": None}, "weight_versions"),
        ({"logprobs": [-0.5, -1.0]}, "logprobs"),
        ({"logprobs": [-0.5, float("nan"), -1.0]}, "logprobs"),
        ({"logprobs": [-0.5, -1e300, -1.0]}, "logprobs"),  # overflows float32
        ({"logprobs": ["a", "b", "c"]}, "logprobs"),
        ({"weight_versions": [1, 2]}, "weight_versions"),
        ({"weight_versions": [1, -1, 2]}, "weight_versions"),
        ({"loss_mask": [1, 0]}, "loss_mask"),
        ({"loss_mask": [1, 2, 0]}, "loss_mask"),
        ({"reward": float("inf")}, "reward"),
        ({"text": "a\x00b"}, "text"),
        ({"finish_reason": "x" * 17}, "finish_reason"),
        ({"timings": {"generate": -1.0}}, "timings"),
        ({"timings": {"generate": "fast"}}, "timings"),
    ],
)
def test_invalid_policy_records_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        policy(**overrides)
    assert info.value.field == (field,)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"logprobs": [-1.0]}, "logprobs"),
        ({"weight_versions": [1]}, "weight_versions"),
        ({"loss_mask": [1]}, "loss_mask"),  # nothing to train on without a log-prob
    ],
)
def test_non_policy_turns_carry_no_policy_data(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        TurnRecord(kind="tool", token_ids=[9], **overrides)
    assert info.value.field == (field,)


@pytest.mark.parametrize(
    ("token_ids", "want"),
    [
        ([0, 2**31 - 1], (0, 2**31 - 1)),
        ((7, 8, 9), (7, 8, 9)),
        ([True, 1, False], (1, 1, 0)),
        ([np.int64(4), np.uint32(5), 6], (4, 5, 6)),
        (np.array([5, 6, 7], dtype=np.int64), (5, 6, 7)),
        (np.array([], dtype=np.float64), ()),
        (range(3), (0, 1, 2)),
    ],
)
def test_integer_sequences_become_tuples_of_plain_ints(
    token_ids: Any, want: tuple[int, ...]
) -> None:
    record = TurnRecord(kind="env", token_ids=token_ids)
    assert record.token_ids == want
    assert all(type(v) is int for v in record.token_ids)


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([1, -1], "must lie in [0, 2147483647]"),
        ([2**31], "must lie in [0, 2147483647]"),
        ([2**32], "must lie in [0, 2147483647]"),
        ([1, 2**64], "must lie in [0, 2147483647]"),  # past what numpy holds
        ([-1, 2**63], "must lie in [0, 2147483647]"),
        ([np.int32(-1)], "must lie in [0, 2147483647]"),
        (np.array([2**31], dtype=np.int64), "must lie in [0, 2147483647]"),
        ([1.0, 2], "must be a flat list of integers"),
        ([np.float64(1.0)], "must be a flat list of integers"),
        (["1"], "must be a flat list of integers"),
        ([[1, 2]], "must be a flat list of integers"),
        ([None], "must be a flat list of integers"),
        (np.array([[1, 2]]), "must be a flat list of integers"),
        (np.array([1.0]), "must be a flat list of integers"),
        ("12", "must be a flat list of integers"),
    ],
)
def test_bad_integer_sequences_are_refused(token_ids: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)) as info:
        TurnRecord(kind="env", token_ids=token_ids)
    assert info.value.field == ("token_ids",)


@pytest.mark.parametrize(
    ("logprobs", "want"),
    [
        ([-0.5, 0.0, -3.4028234663852886e38], (-0.5, 0.0, -3.4028234663852886e38)),
        ([-1, -0.5, True], (-1.0, -0.5, 1.0)),
        (np.array([-0.5, -1.0, -0.25], dtype=np.float32), (-0.5, -1.0, -0.25)),
        ([np.float32(-0.5), -1.0, -0.25], (-0.5, -1.0, -0.25)),
        (["-0.5", "-1", "-0.25"], (-0.5, -1.0, -0.25)),  # numpy parses numeric strings
        ([3e38] * 3, (3e38,) * 3),  # each fits float32 though their norm does not
    ],
)
def test_number_sequences_become_tuples_of_plain_floats(
    logprobs: Any, want: tuple[float, ...]
) -> None:
    record = policy(logprobs=logprobs)
    assert record.logprobs == want
    assert all(type(v) is float for v in record.logprobs or ())


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (float("nan"), "must be finite float32 values"),
        (float("inf"), "must be finite float32 values"),
        (float("-inf"), "must be finite float32 values"),
        (1e39, "must be finite float32 values"),
        (-3.4028235677973366e38, "must be finite float32 values"),  # rounds to -inf
        ("x", "must be a flat list of numbers"),
        ([1.0], "must be a flat list of numbers"),
    ],
)
def test_bad_logprobs_are_refused(bad: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)) as info:
        policy(logprobs=[-0.5, bad, -0.25])
    assert info.value.field == ("logprobs",)


def test_a_2d_logprob_array_is_refused() -> None:
    with pytest.raises(InvalidInput, match="flat list of numbers"):
        policy(logprobs=np.zeros((3, 1)))


def test_a_policy_turn_may_mask_out_some_of_its_tokens() -> None:
    assert policy(loss_mask=[1, 0, 1]).loss_mask == (1, 0, 1)


def test_an_empty_turn_is_valid() -> None:
    record = TurnRecord(kind="policy", token_ids=[], logprobs=[], weight_versions=[])
    assert record.token_ids == () and record.loss_mask == ()


def _row(record: TurnRecord, parent: uuid.UUID | None = None) -> turn_rows.WrittenTurn:
    """The turn as written: a path's row, as a lease reads it from memory or the database."""
    turn = NewTurn(episode_id=uuid.uuid4(), parent_id=parent, record=record)
    return turn_rows.written_turn(turn_rows.turn_values(turn, 0, datetime.now(UTC)))


def test_a_context_concatenates_segments_with_placeholders_for_non_policy_tokens() -> None:
    prompt = _row(TurnRecord(kind="prompt", token_ids=[1, 2]))
    answer = _row(policy(loss_mask=[1, 0, 1]), parent=prompt.id)
    context = turn_rows.context_from_path([prompt, answer])
    assert context.turn_ids == (prompt.id, answer.id)
    assert context.turn_starts == (0, 2)
    assert context.token_ids == (1, 2, 5, 6, 7)
    assert context.logprobs == (0.0, 0.0, -0.5, -1.0, -0.25)
    assert context.loss_mask == (0, 0, 1, 0, 1)
    assert context.weight_versions == (NO_VERSION, NO_VERSION, 3, 3, 4)
    assert context.min_weight_version == 3


def _tree_row(parent: uuid.UUID | None, versions: list[int] | None) -> SimpleNamespace:
    packed = None if versions is None else pack_ints(versions)
    return SimpleNamespace(id=uuid.uuid4(), parent_id=parent, weight_versions=packed)


def test_trajectory_rows_take_every_leaf_and_the_oldest_version_on_its_path() -> None:
    root = _tree_row(None, None)
    old = _tree_row(root.id, [2, 5])
    new = _tree_row(root.id, [7])
    after_old = _tree_row(old.id, None)
    episode = uuid.uuid4()
    rows = turn_rows.trajectory_rows(
        [root, old, new, after_old],
        episode_id=episode,
        run_id=None,
        leaf_turn_ids=None,
        leaf_rewards={new.id: 0.5},
        reward=1.0,
        created_at=datetime.now(UTC),
    )
    by_leaf = {row["leaf_turn_id"]: row for row in rows}
    assert set(by_leaf) == {new.id, after_old.id}
    assert by_leaf[after_old.id]["min_weight_version"] == 2
    assert by_leaf[new.id]["min_weight_version"] == 7
    assert by_leaf[new.id]["reward"] == 0.5 and by_leaf[after_old.id]["reward"] == 1.0
    assert all(row["status"] == "ready" and row["episode_id"] == episode for row in rows)


def test_trajectory_rows_refuse_a_turn_of_another_episode_and_an_empty_tree() -> None:
    root = _tree_row(None, [1])
    common: dict[str, Any] = {
        "episode_id": uuid.uuid4(),
        "run_id": None,
        "leaf_rewards": {},
        "reward": None,
        "created_at": datetime.now(UTC),
    }
    with pytest.raises(InvalidInput, match="not a turn of episode"):
        turn_rows.trajectory_rows([root], leaf_turn_ids=[uuid.uuid4()], **common)
    with pytest.raises(InvalidInput, match="no turns"):
        turn_rows.trajectory_rows([], leaf_turn_ids=None, **common)


def test_rows_hold_packed_bytes() -> None:
    row = _row(policy())
    assert row.token_ids == pack_ints([5, 6, 7])
    assert row.logprobs == pack_floats([-0.5, -1.0, -0.25])
    assert row.loss_mask == pack_mask([1, 1, 1])


def test_a_record_checked_upstream_equals_the_checked_one() -> None:
    """The episode loop's records of an engine's answer and a template's delta skip the
    token checks (`TurnRecord.checked_upstream`); they are the records the checks make."""
    made = TurnRecord.checked_upstream(
        "policy",
        (5, 6, 7),
        logprobs=(-0.5, -1.0, -0.25),
        weight_versions=(3, 3, 4),
        finish_reason="stop",
        timings={"generate": 0.5},
    )
    assert made == policy(finish_reason="stop", timings={"generate": 0.5})
    env = TurnRecord.checked_upstream("env", (1, 2), reward=0.5, timings={"env": 0.1})
    assert env == TurnRecord(kind="env", token_ids=(1, 2), reward=0.5, timings={"env": 0.1})


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("env", {"reward": float("nan")}, "reward must be finite"),
        ("policy", {"logprobs": (-0.5,), "weight_versions": (1, 1)}, "logprobs has 1 entries"),
        ("policy", {"logprobs": (-0.5, -0.5), "weight_versions": (1,)}, "weight_versions has"),
        ("policy", {"logprobs": (-0.5, -0.5)}, "needs logprobs and weight_versions"),
        ("env", {"logprobs": (-0.5, -0.5)}, "only policy turns carry"),
        ("env", {"images": (b"not an image",)}, "PNG"),
    ],
)
def test_a_record_checked_upstream_still_refuses_what_is_not_a_token_s(
    kind: Any, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        TurnRecord.checked_upstream(kind, (1, 2), timings={}, **extra)


@pytest.mark.parametrize("native", [True, False], ids=["memoryview", "numpy"])
def test_version_bounds_read_the_packed_versions_either_way(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's packed versions are read as a view where this machine's int32 matches the
    stored little-endian one, else through numpy: the same bounds."""
    monkeypatch.setattr(packing, "_NATIVE", native)
    assert turn_rows.min_version(pack_ints([5, 3, 2**31 - 1, 9])) == 3
    assert turn_rows.min_version(None) is None and turn_rows.min_version(b"") is None
    packed = [None, pack_ints([4, 2]), b"", pack_ints([7, 0, 6])]
    assert turn_rows.version_range(packed) == (0, 7)
    assert turn_rows.version_range([None, b""]) is None
