"""Micro-batches: layout under the budget, shifted targets and masks, log-probs equal to
per-sequence scoring in both layouts, and rejection of unusable trajectories."""

from __future__ import annotations

import dataclasses
import random
import uuid
from datetime import UTC, datetime
from typing import Literal

import pytest
import torch

from agentflow.errors import InvalidInput
from agentflow.modeling import ModelInit, build_model, score
from agentflow.types import NO_VERSION, Trajectory
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
from trainer.batching import (
    BatchingConfig,
    InvalidTrajectory,
    build_microbatches,
    split_valid,
    validate,
)

TINY = ModelInit(layers=1, hidden=32, heads=2)


def make_trajectory(
    n: int, rng: random.Random, *, group: str | None = "g", reward: float = 1.0
) -> Trajectory:
    """A prompt (a third of the tokens) then alternating policy and env segments."""
    prompt = max(1, n // 3)
    mask = [0] * prompt + [(k // 7 + 1) % 2 for k in range(n - prompt)]
    if not any(mask[1:]):
        mask[-1] = 1
    return Trajectory(
        id=uuid.uuid4(),
        run_id=None,
        episode_id=uuid.uuid4(),
        group_id=group,
        leaf_turn_id=uuid.uuid4(),
        reward=reward,
        status="ready",
        times_served=0,
        min_weight_version=0,
        created_at=datetime.now(UTC),
        turn_ids=(),
        turn_starts=(),
        token_ids=tuple(rng.randrange(3, 250) for _ in range(n)),
        logprobs=tuple(-3 * rng.random() if m else 0.0 for m in mask),
        loss_mask=tuple(mask),
        weight_versions=tuple(0 if m else NO_VERSION for m in mask),
    )


@pytest.fixture
def batch() -> list[Trajectory]:
    rng = random.Random(0)
    return [make_trajectory(rng.randrange(4, 60), rng) for _ in range(11)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_layout_respects_budget_and_places_every_token(
    batch: list[Trajectory], layout: Literal["padded", "packed"]
) -> None:
    config = BatchingConfig(max_tokens_per_microbatch=128, layout=layout, max_row_tokens=96)
    advantages = [float(i) for i in range(len(batch))]
    mbs = build_microbatches(batch, advantages, config)
    seen = sorted(s.index for mb in mbs for s in mb.spans)
    assert seen == list(range(len(batch)))
    for mb in mbs:
        rows, width = mb.input_ids.shape
        assert rows * width <= 128
        assert mb.num_policy_tokens == int(mb.loss_mask.sum())
        assert (mb.attention_mask is None) == (layout == "padded")
        for s in mb.spans:
            t = batch[s.index]
            seg = slice(s.start, s.start + s.length)
            last = s.start + s.length - 1
            assert mb.input_ids[s.row, seg].tolist() == list(t.token_ids)
            assert mb.position_ids[s.row, seg].tolist() == list(range(s.length))
            # Position j predicts token j+1: targets and per-token values are shifted.
            assert mb.targets[s.row, s.start : last].tolist() == list(t.token_ids[1:])
            assert mb.loss_mask[s.row, s.start : last].tolist() == [
                bool(m) for m in t.loss_mask[1:]
            ]
            assert mb.behaviour_logprobs[s.row, s.start : last].tolist() == pytest.approx(
                t.logprobs[1:]
            )
            assert not mb.target_valid[s.row, last] and not mb.loss_mask[s.row, last]
            assert set(mb.advantages[s.row, seg].tolist()) == {advantages[s.index]}
            assert set(mb.loss_weights[s.row, seg].tolist()) == {1.0}
    if layout == "packed":
        assert any(len({s.row for s in mb.spans}) < len(mb.spans) for mb in mbs)


def test_packed_mask_is_block_diagonal_causal(batch: list[Trajectory]) -> None:
    config = BatchingConfig(layout="packed", max_row_tokens=128, max_tokens_per_microbatch=128)
    mb = build_microbatches(batch[:4], [0.0] * 4, config)[0]
    assert mb.attention_mask is not None
    mask = mb.attention_mask[:, 0]
    for s in mb.spans:
        block = mask[s.row, s.start : s.start + s.length, s.start : s.start + s.length]
        assert torch.equal(block, torch.ones_like(block).tril())
        # No position of this trajectory sees any position outside it.
        outside = mask[s.row, s.start : s.start + s.length].clone()
        outside[:, s.start : s.start + s.length] = False
        assert not outside.any()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_log_probs_equal_per_sequence_scoring(
    batch: list[Trajectory], layout: Literal["padded", "packed"]
) -> None:
    torch.set_num_threads(1)
    model = build_model(TINY, seed=1)
    config = BatchingConfig(max_tokens_per_microbatch=160, layout=layout, max_row_tokens=120)
    policy = TorchPolicy(model, TorchBackendConfig(batching=config))
    worst = 0.0
    for mb in build_microbatches(batch, [0.0] * len(batch), config):
        grid = policy.logprobs(mb, temperature=0.8)
        for s in mb.spans:
            expected = torch.tensor(score(model, list(batch[s.index].token_ids), 0.8))
            got = grid[s.row, s.start : s.start + s.length - 1]
            worst = max(worst, float((got - expected).abs().max()))
    assert worst <= 1e-5


def test_loss_weight_is_broadcast(batch: list[Trajectory]) -> None:
    stale = dataclasses.replace(batch[0], loss_weight=0.25)
    mb = build_microbatches([stale, batch[1]], [1.0, -1.0])[0]
    by_index = {s.index: s for s in mb.spans}
    s = by_index[0]
    assert set(mb.loss_weights[s.row, s.start : s.start + s.length].tolist()) == {0.25}


def _broken(t: Trajectory, **changes: object) -> Trajectory:
    return dataclasses.replace(t, **changes)  # type: ignore[arg-type]


def test_bad_trajectories_are_rejected_with_reasons(batch: list[Trajectory]) -> None:
    good = batch[0]
    n = len(good.token_ids)
    bad = {
        "logprobs": _broken(good, logprobs=good.logprobs[:-1]),
        "loss_mask": _broken(good, loss_mask=good.loss_mask + (0,)),
        "weight_versions": _broken(good, weight_versions=()),
        "empty": _broken(good, token_ids=(), logprobs=(), loss_mask=(), weight_versions=()),
        "no policy": _broken(good, loss_mask=(0,) * n),
        "first only": _broken(good, loss_mask=(1,) + (0,) * (n - 1)),
        "nan": _broken(good, logprobs=(float("nan"),) * n),
        "weight": _broken(good, loss_weight=-1.0),
    }
    valid, rejected = split_valid([good, *bad.values(), batch[1]])
    assert valid == [good, batch[1]]
    assert [t for t, _ in rejected] == list(bad.values())
    reasons = dict(zip(bad, (why for _, why in rejected), strict=True))
    assert "logprobs has" in reasons["logprobs"]
    assert "loss_mask has" in reasons["loss_mask"]
    assert "weight_versions has" in reasons["weight_versions"]
    assert "no tokens" in reasons["empty"]
    assert (
        "no policy tokens" in reasons["no policy"] and "no policy tokens" in reasons["first only"]
    )
    with pytest.raises(InvalidTrajectory) as err:
        validate(bad["logprobs"])
    assert isinstance(err.value, InvalidInput) and err.value.field == ("logprobs",)
    with pytest.raises(InvalidTrajectory):
        build_microbatches([good, bad["empty"]], [0.0, 0.0])


def test_budget_and_vocab_limits_reject(batch: list[Trajectory]) -> None:
    longest = max(batch, key=lambda t: len(t.token_ids))
    valid, rejected = split_valid(batch, max_tokens=len(longest.token_ids) - 1, vocab_size=260)
    assert longest not in valid and rejected[0][0] is longest
    high = _broken(batch[0], token_ids=(300,) * len(batch[0].token_ids))
    assert split_valid([high], vocab_size=260)[1][0][1].startswith("token ids")
    with pytest.raises(InvalidInput):
        build_microbatches(batch[:2], [0.0])
    with pytest.raises(InvalidInput):
        build_microbatches(batch[:1], [float("inf")])
