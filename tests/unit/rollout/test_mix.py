from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from agentflow.errors import InvalidInput
from agentflow.rollout.mix import SourceMix, blame, revise_mix
from agentflow.run_config import EnvEntry, EnvMixChange


def test_equal_weights_take_turns() -> None:
    mix = SourceMix([1.0, 1.0, 1.0, 1.0])
    picks = [mix.pick() for _ in range(12)]
    assert picks == [0, 1, 2, 3] * 3  # every window of four groups holds every env


def test_each_window_holds_each_env_to_within_one_group() -> None:
    weights = [5.0, 2.0, 1.0]
    mix = SourceMix(weights)
    picks = [mix.pick() for _ in range(800)]
    for start in range(0, 800, 8):  # a window of sum(weights) picks
        assert Counter(picks[start : start + 8]) == {0: 5, 1: 2, 2: 1}
    # Interleaved, not in runs: the heavy env never goes more than twice in a row.
    assert all(picks[i : i + 3] != [0, 0, 0] for i in range(len(picks) - 2))


def test_fractional_weights_keep_their_share() -> None:
    mix = SourceMix([0.3, 0.7])
    counts = Counter(mix.pick() for _ in range(1000))
    assert abs(counts[0] - 300) <= 1 and abs(counts[1] - 700) <= 1


@pytest.mark.parametrize("weights", [[], [1.0, 0.0], [1.0, -2.0]])
def test_a_mix_without_positive_weights_is_refused(weights: list[float]) -> None:
    with pytest.raises(InvalidInput) as refused:
        SourceMix(weights)
    assert refused.value.field[0] == "envs"


# ---- a change of a live run's mix ---------------------------------------------------

GUESS, VAULT = "agentflow/guess-number-v0", "agentflow/vault-v0"


def _entries(*pairs: tuple[str, float]) -> list[EnvEntry]:
    return [EnvEntry(id=env_id, weight=weight) for env_id, weight in pairs]


def _change(**fields: object) -> EnvMixChange:
    return EnvMixChange.model_validate(fields)


def test_set_changes_in_place_adds_at_the_end_and_remove_takes_out() -> None:
    mix = _entries((GUESS, 1.0))
    added = revise_mix(mix, _change(set=[{"id": VAULT, "max_concurrency": 8}]))
    assert [(e.id, e.weight, e.max_concurrency) for e in added] == [
        (GUESS, 1.0, 64),
        (VAULT, 1.0, 8),
    ]
    reweighted = revise_mix(added, _change(set=[{"id": GUESS, "weight": 3}]))
    assert [(e.id, e.weight, e.max_concurrency) for e in reweighted] == [
        (GUESS, 3.0, 64),
        (VAULT, 1.0, 8),
    ]
    assert [e.id for e in revise_mix(reweighted, _change(remove=[GUESS]))] == [VAULT]
    whole = revise_mix(reweighted, _change(envs=[{"id": GUESS}]))
    assert [(e.id, e.weight) for e in whole] == [(GUESS, 1.0)]


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"remove": [GUESS]}, ("remove",), "at least one env"),
        ({"remove": [VAULT]}, ("remove", "0"), "not in the run's mix"),
        ({"set": [{"id": GUESS}], "remove": [GUESS]}, ("set", "0", "id"), "both set and removed"),
        ({"set": [{"id": "reg", "kwargs": {"a": 1}}]}, ("set", "0", "kwargs"), "registered env"),
    ],
)
def test_a_bad_change_names_its_field(
    change: dict[str, object], field: tuple[str, ...], says: str
) -> None:
    with pytest.raises(InvalidInput, match=says) as refused:
        revise_mix(_entries((GUESS, 1.0)), _change(**change))
    assert refused.value.field == field


def test_one_id_twice_needs_the_whole_mix() -> None:
    twice = [EnvEntry(id=GUESS), EnvEntry(id=GUESS, kwargs={"low": 1})]
    with pytest.raises(InvalidInput, match="whole mix") as refused:
        revise_mix(twice, _change(set=[{"id": GUESS, "weight": 2}]))
    assert refused.value.field == ("set", "0", "id")


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"envs": [{"id": GUESS}], "remove": [GUESS]},
        {"set": [{"id": GUESS, "weight": float("inf")}]},
    ],
)
def test_a_change_must_say_one_thing_in_one_form(change: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        _change(**change)


def test_a_refusal_of_the_new_mix_names_the_edit_that_made_it() -> None:
    change = _change(set=[{"id": VAULT}])
    entries = revise_mix(_entries((GUESS, 1.0)), change)
    assert blame(change, entries, ("envs", "1", "id")) == ("set", "0", "id")
    assert blame(change, entries, ("envs", "0", "id")) == ("envs", "0", "id")  # untouched
    whole = _change(envs=[{"id": VAULT}])
    assert blame(whole, revise_mix(entries, whole), ("envs", "0", "id")) == ("envs", "0", "id")
