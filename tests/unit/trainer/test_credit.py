"""Credit across turns (`trainer.credit`): returns-to-go, turn-level GRPO, and RTPO's
reverse tree (each turn once, its advantage from its own continuations, deepest first,
trained on exactly its own context)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from agentflow.types import NO_VERSION, Trajectory
from trainer.batching import build_microbatches
from trainer.credit import (
    by_depth_deepest_first,
    policy_turn_spans,
    return_to_go,
    reverse_tree,
    turn_level_advantages,
)

# A turn: (id, kind, tokens, reward). Policy turns hold 2 tokens, the others 3.
Turn = tuple[uuid.UUID, str, int, float]


def turn(kind: str, reward: float = 0.0) -> Turn:
    return (uuid.uuid4(), kind, 2 if kind == "policy" else 3, reward)


def path_trajectory(turns: list[Turn], reward: float, group: str = "g") -> Trajectory:
    ids, mask, starts = [], [], []
    for _, kind, n, _ in turns:
        starts.append(len(ids))
        ids += [7] * n
        mask += [1 if kind == "policy" else 0] * n
    return Trajectory(
        id=uuid.uuid4(),
        run_id=None,
        episode_id=uuid.uuid4(),
        group_id=group,
        leaf_turn_id=turns[-1][0],
        reward=reward,
        status="ready",
        times_served=0,
        min_weight_version=0,
        created_at=datetime.now(UTC),
        turn_ids=tuple(t[0] for t in turns),
        turn_starts=tuple(starts),
        token_ids=tuple(ids),
        logprobs=tuple(-1.0 if m else 0.0 for m in mask),
        loss_mask=tuple(mask),
        weight_versions=tuple(0 if m else NO_VERSION for m in mask),
        turn_rewards=tuple(t[3] for t in turns),
    )


def test_return_to_go_drops_what_was_paid_before_the_turn() -> None:
    turns = [turn("prompt"), turn("policy"), turn("env", 0.2), turn("policy"), turn("env", 1.0)]
    t = path_trajectory(turns, reward=1.2)
    first, second = policy_turn_spans(t)
    assert (first.ordinal, second.ordinal) == (0, 1)
    assert return_to_go(t, first) == pytest.approx(1.2)
    assert return_to_go(t, second) == pytest.approx(1.0)


def test_turn_level_advantages_compare_turns_at_the_same_position() -> None:
    # Two episodes: the first's second turn earned the final reward, the second's did not;
    # their first turns were paid the same 0.2 on the way.
    a = [turn("prompt"), turn("policy"), turn("env", 0.2), turn("policy"), turn("env", 1.0)]
    b = [turn("prompt"), turn("policy"), turn("env", 0.2), turn("policy"), turn("env", 0.0)]
    ta, tb = path_trajectory(a, 1.2), path_trajectory(b, 0.2)
    adv_a, adv_b = turn_level_advantages([ta, tb])
    first_a, second_a = policy_turn_spans(ta)
    assert adv_a[second_a.start] == pytest.approx(1.0, abs=1e-4)  # (1 - 0.5) / 0.5
    assert adv_b[policy_turn_spans(tb)[1].start] == pytest.approx(-1.0, abs=1e-4)
    assert adv_a[first_a.start] == pytest.approx(1.0, abs=1e-4)  # returns-to-go 1.2 vs 0.2
    assert all(adv_a[k] == 0.0 for k in range(len(adv_a)) if not ta.loss_mask[k])


def test_rtpo_advantages_come_from_each_turns_own_continuations() -> None:
    """One episode re-rolled from its second turn: the key (turn 1) is shared, so the two
    second turns are compared with each other only; the first turns of two episodes of
    the task are compared at the root."""
    prompt, key, after_key = turn("prompt"), turn("policy"), turn("env")
    dial_a, end_a = turn("policy"), turn("env", 1.0)
    dial_b, end_b = turn("policy"), turn("env", 0.0)
    main = path_trajectory([prompt, key, after_key, dial_a, end_a], 1.0)
    branch = path_trajectory([prompt, key, after_key, dial_b, end_b], 0.0)
    other_prompt, other_key, other_after = turn("prompt"), turn("policy"), turn("env")
    other_dial, other_end = turn("policy"), turn("env", 0.0)
    other = path_trajectory([other_prompt, other_key, other_after, other_dial, other_end], 0.0)
    nodes = {n.turn_id: n for n in reverse_tree([main, branch, other])}
    assert len(nodes) == 5  # the shared key turn once
    assert nodes[key[0]].returns == [1.0, 0.0]  # both continuations pass through it
    assert nodes[dial_a[0]].advantage == pytest.approx(1.0, abs=1e-4)
    assert nodes[dial_b[0]].advantage == pytest.approx(-1.0, abs=1e-4)
    # Root: the key's value 0.5 against the other episode's 0.
    assert nodes[key[0]].advantage == pytest.approx(1.0, abs=1e-4)
    assert nodes[other_key[0]].advantage == pytest.approx(-1.0, abs=1e-4)
    # The other episode's dial had no siblings: it takes its key's advantage.
    assert nodes[other_dial[0]].advantage == pytest.approx(-1.0, abs=1e-4)
    # Deepest first; each turn trained on its own context, loss on its own tokens only.
    levels = by_depth_deepest_first(list(nodes.values()))
    assert [{n.depth for n in level} for level in levels] == [{1}, {0}]
    dial = nodes[dial_b[0]].sample
    assert dial.token_ids == branch.token_ids[: len(dial.token_ids)]
    assert sum(dial.loss_mask) == 2 and dial.loss_mask[-2:] == (1, 1)
    first = nodes[key[0]].sample
    assert len(first.token_ids) == 3 + 2 and sum(first.loss_mask) == 2


def test_per_token_advantages_land_where_their_tokens_are_predicted() -> None:
    turns = [turn("prompt"), turn("policy"), turn("env"), turn("policy")]
    t = path_trajectory(turns, 1.0)
    per_token = [0.0, 0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 0.0, -2.0, -2.0]
    (mb,) = build_microbatches([t], [per_token])
    assert mb.policy_values(mb.advantages).tolist() == [5.0, 5.0, -2.0, -2.0]
    with pytest.raises(Exception, match="per-token advantages"):
        build_microbatches([t], [[1.0, 2.0]])


VAULT = {"name": "v", "envs": [{"id": "agentflow/vault-v0"}], "agent": {"max_turns": 3}}


@pytest.mark.parametrize(
    ("patch", "said"),
    [
        ({"rtpo": {"branches": 2}}, "set trainer.algorithm = 'rtpo'"),
        (
            {
                "trainer": {"algorithm": "rtpo"},
                "agent": {"type": "http", "url": "http://127.0.0.1:9/", "max_turns": 3},
            },
            "agent.type must be 'whitebox'",
        ),
        (
            {
                "trainer": {"algorithm": "rtpo"},
                "teachers": [{"name": "t", "path": "/x", "envs": ["agentflow/vault-v0"]}],
            },
            "rtpo with teachers",
        ),
        (
            {
                "trainer": {"algorithm": "rtpo"},
                "envs": [{"id": "agentflow/vault-v0", "reward": "agentflow.plugins:call"}],
            },
            "own return",
        ),
    ],
)
def test_rtpo_configs_that_cannot_work_are_refused(patch: dict[str, object], said: str) -> None:
    from pydantic import ValidationError

    from agentflow.run_config import RunConfig

    with pytest.raises(ValidationError, match=said):
        RunConfig.model_validate({**VAULT, **patch})


def test_the_sample_budget_counts_re_rolls() -> None:
    from agentflow.run_config import RunConfig

    rtpo = RunConfig.model_validate(
        {
            **VAULT,
            "rollout": {"group_size": 4},
            "trainer": {"algorithm": "rtpo", "batch_episodes": 96},
            "rtpo": {"branches": 2},
        }
    )
    assert rtpo.samples_per_group() == 4 * (1 + 2 * 2)  # two turns after the first
    limited = rtpo.model_copy(update={"rtpo": rtpo.rtpo.model_copy(update={"branch_turns": 1})})
    assert limited.samples_per_group() == 4 * (1 + 2)
    grpo = RunConfig.model_validate({**VAULT, "rollout": {"group_size": 12}})
    assert grpo.samples_per_group() == 12


class _RecordingPolicy:
    """Records each optimizer step's turns and advantages (no model)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, float]]] = []

    def train_step(self, samples: list, advantages: list[float], algorithm: object) -> dict:  # type: ignore[type-arg]
        self.steps.append([(len(s.token_ids), a) for s, a in zip(samples, advantages, strict=True)])
        return {"optimizer_steps": 1.0, "loss": 0.5}


@pytest.mark.parametrize("joint", [False, True], ids=["reverse", "joint"])
def test_rtpo_updates_deepest_first_or_all_at_once(joint: bool) -> None:
    """`rtpo.update`: reverse takes one step per turn depth, deepest first; joint (the
    ablation) trains the same turns with the same advantages in one step."""
    from trainer.algorithms import AlgorithmConfig
    from trainer.loop import rtpo_step

    prompt, key, after_key = turn("prompt"), turn("policy"), turn("env")
    main = path_trajectory([prompt, key, after_key, turn("policy"), turn("env", 1.0)], 1.0)
    branch = path_trajectory([prompt, key, after_key, turn("policy"), turn("env", 0.0)], 0.0)
    other = path_trajectory(
        [turn("prompt"), turn("policy"), turn("env"), turn("policy"), turn("env", 0.0)], 0.0
    )
    policy = _RecordingPolicy()
    metrics = rtpo_step(policy, [main, branch, other], AlgorithmConfig(), True, joint=joint)  # type: ignore[arg-type]
    # Turn contexts: a dial's sample is 3 + 2 + 3 + 2 tokens long, a key's 3 + 2.
    reverse = [[(10, 1.0), (10, -1.0), (10, -1.0)], [(5, 1.0), (5, -1.0)]]
    rounded = [sorted(((n, round(a, 3)) for n, a in step), reverse=True) for step in policy.steps]
    expected = (
        [sorted(reverse[0] + reverse[1], reverse=True)]
        if joint
        else [sorted(s, reverse=True) for s in reverse]
    )
    assert rounded == expected
    assert metrics["rtpo_turns"] == 5 and metrics["rtpo_depths"] == 2
    assert metrics["optimizer_steps"] == (1 if joint else 2)
