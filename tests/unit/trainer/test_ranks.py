"""How rank 0 splits a batch between the trainer ranks and combines their metrics."""

from __future__ import annotations

import random

import pytest

from tests.unit.trainer.test_batching import make_trajectory
from trainer.ranks import combine, shares


def test_shares_cover_the_batch_once_balanced_by_tokens() -> None:
    rng = random.Random(0)
    batch = [make_trajectory(rng.randrange(5, 200), rng) for _ in range(13)]
    split = shares(batch, 3)
    assert sorted(i for share in split for i in share) == list(range(13))
    loads = [sum(len(batch[i].token_ids) for i in share) for share in split]
    assert max(loads) - min(loads) <= max(len(t.token_ids) for t in batch)
    assert shares(batch, 3) == split  # the same on every call


def test_a_batch_smaller_than_the_ranks_leaves_some_empty() -> None:
    rng = random.Random(1)
    batch = [make_trajectory(10, rng), make_trajectory(30, rng)]
    assert shares(batch, 4) == [[1], [0], [], []]


def test_metrics_combine_into_the_batchs() -> None:
    ranks = [
        {"loss": 0.25, "policy_tokens": 30.0, "tokens": 50.0, "trajectories": 3.0,
         "clip_frac": 0.1, "max_is_weight": 1.5, "grad_norm": 2.0, "lr": 1e-3,
         "seconds": 2.0},
        {"loss": 0.5, "policy_tokens": 10.0, "tokens": 30.0, "trajectories": 1.0,
         "clip_frac": 0.5, "max_is_weight": 1.2, "grad_norm": 2.0, "lr": 1e-3,
         "seconds": 4.0},
    ]  # fmt: skip
    out = combine(ranks)
    assert out["loss"] == 0.75  # each rank's share of the batch-normalised loss
    assert (out["policy_tokens"], out["tokens"], out["trajectories"]) == (40.0, 80.0, 4.0)
    assert out["clip_frac"] == pytest.approx((0.1 * 30 + 0.5 * 10) / 40)  # per token
    assert out["max_is_weight"] == 1.5
    assert (out["grad_norm"], out["lr"]) == (2.0, 1e-3)  # the same on every rank
    assert out["seconds"] == 4.0 and out["tokens_per_s"] == 20.0  # the slowest rank
    assert out["ranks"] == 2.0


def test_an_idle_ranks_empty_means_do_not_dilute_the_batchs() -> None:
    busy = {"policy_tokens": 8.0, "clip_frac": 0.25, "loss": 1.0, "seconds": 1.0}
    idle = {"policy_tokens": 0.0, "loss": 0.0, "seconds": 1.0}
    out = combine([busy, idle])
    assert out["clip_frac"] == 0.25 and out["loss"] == 1.0
