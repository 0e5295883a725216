from __future__ import annotations

import pytest

from agentflow.errors import InvalidInput
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.lanes import EnvLanes, lane_key
from agentflow.run_config import EnvEntry

GUESS, VAULT = "agentflow/guess-number-v0", "agentflow/vault-v0"


def _resolved(*entries: EnvEntry) -> tuple[list[EnvEntry], list[EnvSource]]:
    sources = [
        EnvSource(e.id, e.weight, e.max_concurrency, None, kwargs=dict(e.kwargs)) for e in entries
    ]
    return list(entries), sources


def test_a_weight_or_cap_change_keeps_the_lane_and_a_new_env_opens_one() -> None:
    lanes = EnvLanes(*_resolved(EnvEntry(id=GUESS, max_concurrency=4)))
    guess = lanes[lane_key(EnvEntry(id=GUESS))]
    lanes.apply(
        lanes.prepare(
            *_resolved(
                EnvEntry(id=GUESS, weight=3, max_concurrency=2), EnvEntry(id=VAULT, weight=1)
            )
        )
    )
    assert lanes[lane_key(EnvEntry(id=GUESS))] is guess  # the same lane, its new cap
    assert guess.slots.limit == 2 and guess.entry.weight == 3
    assert [weight for _, weight in lanes.mix] == [3, 1]


def test_a_lane_that_leaves_the_mix_stays_for_its_groups() -> None:
    lanes = EnvLanes(*_resolved(EnvEntry(id=GUESS), EnvEntry(id=VAULT)))
    lanes.apply(lanes.prepare(*_resolved(EnvEntry(id=VAULT))))
    assert [key for key, _ in lanes.mix] == [lane_key(EnvEntry(id=VAULT))]
    assert lanes[lane_key(EnvEntry(id=GUESS))].entry.id == GUESS  # still there


def test_other_kwargs_are_another_lane() -> None:
    plain, narrow = EnvEntry(id=GUESS), EnvEntry(id=GUESS, kwargs={"high": 8})
    assert lane_key(plain) != lane_key(narrow)
    lanes = EnvLanes(*_resolved(plain))
    lanes.apply(lanes.prepare(*_resolved(narrow)))
    assert set(lanes.lanes) == {lane_key(plain), lane_key(narrow)}


def test_a_reward_function_that_does_not_load_changes_nothing() -> None:
    lanes = EnvLanes(*_resolved(EnvEntry(id=GUESS)))
    before = list(lanes.mix)
    broken = EnvEntry.model_construct(
        id=VAULT, weight=1.0, max_concurrency=64, kwargs={}, reward="no.such.module:fn"
    )
    with pytest.raises(InvalidInput) as refused:
        lanes.prepare(*_resolved(EnvEntry(id=GUESS), broken))
    assert refused.value.field[:2] == ("envs", "1")
    assert lanes.mix == before and len(lanes.lanes) == 1
