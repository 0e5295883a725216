from __future__ import annotations

from collections import Counter

import pytest

from agentflow.errors import InvalidInput
from agentflow.rollout.mix import SourceMix


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
