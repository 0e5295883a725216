"""TorchPolicy: a step improves the objective, the proximal shortcut is exact, checkpoints
restore everything, temperature handling matches the engine's scoring."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pytest
import torch

from agentflow.errors import InvalidInput, NotFound
from agentflow.modeling import ModelInit, build_model, load_model, score
from agentflow.types import Trajectory
from tests.unit.trainer.test_batching import make_trajectory
from trainer.algorithms import AlgorithmConfig, group_advantages, policy_loss
from trainer.backends.torch_backend import (
    TorchBackendConfig,
    TorchPolicy,
    _split,
    checkpoint_dir,
    latest_checkpoint,
)
from trainer.batching import BatchingConfig, build_microbatches

TINY = ModelInit(layers=2, hidden=32, heads=2)
SMALL_BATCHES = BatchingConfig(max_tokens_per_microbatch=200)  # several micro-batches


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _on_policy(
    model: torch.nn.Module, trajectories: Sequence[Trajectory], t: float
) -> list[Trajectory]:
    """The trajectories with behaviour log-probs that `model` itself gives (0 elsewhere)."""
    out = []
    for traj in trajectories:
        scored = [0.0, *score(model, list(traj.token_ids), t)]  # type: ignore[arg-type]
        lp = tuple(s if m else 0.0 for s, m in zip(scored, traj.loss_mask, strict=True))
        out.append(dataclasses.replace(traj, logprobs=lp))
    return out


def _batch(
    model: torch.nn.Module, n: int = 12, seed: int = 0, t: float = 1.0
) -> tuple[list[Trajectory], list[float]]:
    rng = random.Random(seed)
    trajs = [
        make_trajectory(
            rng.randrange(10, 50), rng, group=f"g{i // 4}", reward=float(rng.random() < 0.5)
        )
        for i in range(n)
    ]
    trajs = _on_policy(model, trajs, t)
    adv = group_advantages([tr.reward or 0.0 for tr in trajs], [tr.group_id for tr in trajs])
    return trajs, adv


def _surrogate(policy: TorchPolicy, trajs: list[Trajectory], adv: list[float]) -> float:
    """Plain PPO surrogate against the (fixed) behaviour log-probs at the current weights."""
    total, n = 0.0, 0
    for mb in build_microbatches(trajs, adv):
        grid = policy.logprobs(mb)
        loss, metrics = policy_loss(
            mb.policy_values(grid),
            mb.policy_values(grid),
            mb.policy_values(mb.behaviour_logprobs),
            mb.policy_values(mb.advantages),
            mb.policy_values(mb.loss_weights),
            AlgorithmConfig(decoupled=False),
        )
        total += float(loss) * metrics["tokens"]
        n += int(metrics["tokens"])
    return total / n


def test_one_step_lowers_the_loss_on_a_fixed_batch() -> None:
    model = build_model(TINY, seed=0)
    trajs, adv = _batch(model)
    policy = TorchPolicy(model, TorchBackendConfig(lr=1e-2, batching=SMALL_BATCHES))
    before = _surrogate(policy, trajs, adv)
    metrics = policy.train_step(trajs, adv, AlgorithmConfig())
    after = _surrogate(policy, trajs, adv)
    assert after < before
    assert metrics["microbatches"] > 1 and metrics["optimizer_steps"] == 1
    assert metrics["tokens"] == sum(len(t.token_ids) for t in trajs)
    assert metrics["policy_tokens"] == sum(sum(t.loss_mask[1:]) for t in trajs)
    # On-policy data: importance weights 1 (up to float32 noise), nothing clipped.
    assert metrics["is_weight_dev"] < 1e-4 and metrics["clip_frac"] == 0.0
    for key in ("loss", "grad_norm", "tokens_per_s", "entropy", "approx_kl", "max_is_weight"):
        assert key in metrics
    # Plain PPO: the reported loss is taken against the behaviour log-probs, so a second
    # step on the same batch reports a lower one.
    plain = TorchPolicy(build_model(TINY, seed=0), TorchBackendConfig(lr=1e-2))
    first = plain.train_step(trajs, adv, AlgorithmConfig(decoupled=False))
    second = plain.train_step(trajs, adv, AlgorithmConfig(decoupled=False))
    assert second["loss"] < first["loss"]


def test_reusing_the_gradient_pass_as_proximal_is_exact() -> None:
    """With one optimizer step per batch, `auto` (no separate proximal forward) and
    `recompute` produce the same update."""
    base = build_model(TINY, seed=0)
    trajs, adv = _batch(base, seed=1)
    # Off-policy data: behaviour log-probs a little away from the current weights.
    noise = random.Random(5)
    trajs = [
        dataclasses.replace(
            t, logprobs=tuple(x - 0.3 * noise.random() if x else 0.0 for x in t.logprobs)
        )
        for t in trajs
    ]
    results = []
    modes: tuple[Literal["auto", "recompute"], ...] = ("auto", "recompute")
    for mode in modes:
        policy = TorchPolicy(
            copy.deepcopy(base), TorchBackendConfig(lr=1e-2, batching=SMALL_BATCHES)
        )
        metrics = policy.train_step(trajs, adv, AlgorithmConfig(proximal=mode))
        results.append((metrics, policy.state_dict()))
    (auto_m, auto_w), (re_m, re_w) = results
    assert auto_m["is_weight_dev"] > 0.01
    for key in ("loss", "grad_norm", "is_weight_dev", "clip_frac"):
        assert auto_m[key] == pytest.approx(re_m[key], rel=1e-5, abs=1e-7)
    for name in auto_w:
        torch.testing.assert_close(auto_w[name], re_w[name], rtol=0, atol=1e-6)


def test_non_policy_values_do_not_change_the_step() -> None:
    """Behaviour log-probs of non-policy tokens (0.0 by convention) are never read."""
    base = build_model(TINY, seed=0)
    trajs, adv = _batch(base, n=6, seed=4)
    odd = [
        dataclasses.replace(
            t,
            logprobs=tuple(x if m else -7.5 for x, m in zip(t.logprobs, t.loss_mask, strict=True)),
        )
        for t in trajs
    ]
    results = []
    for batch in (trajs, odd):
        policy = TorchPolicy(copy.deepcopy(base), TorchBackendConfig(lr=1e-2))
        results.append((policy.train_step(batch, adv), policy.state_dict()))
    (m1, w1), (m2, w2) = results
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    assert all(torch.equal(w1[name], w2[name]) for name in w1)


def test_minibatches_take_one_step_each() -> None:
    model = build_model(TINY, seed=0)
    trajs, adv = _batch(model, seed=2)
    policy = TorchPolicy(model, TorchBackendConfig(lr=3e-2))
    metrics = policy.train_step(trajs, adv, AlgorithmConfig(minibatches=3))
    assert metrics["optimizer_steps"] == 3
    assert policy.optimizer.state[next(iter(model.parameters()))]["step"] == 3


@pytest.mark.parametrize(("n", "parts"), [(128, 8), (10, 3), (3, 5), (1, 1)])
def test_minibatches_are_dealt_across_groups(n: int, parts: int) -> None:
    split = _split(n, parts)
    assert sorted(i for part in split for i in part) == list(range(n))
    assert len(split) == min(n, parts) and all(split)
    assert max(map(len, split)) - min(map(len, split)) <= 1
    # A batch holds each group's samples side by side: every minibatch gets one of each
    # group of `parts`, so every optimizer step sees every task of the batch.
    width = len(split)
    for start in range(0, n - width + 1, width):
        group = set(range(start, start + width))
        assert all(len(group & set(part)) == 1 for part in split)


def test_kl_needs_a_reference_and_starts_at_zero() -> None:
    model = build_model(TINY, seed=0)
    trajs, adv = _batch(model, n=4)
    with pytest.raises(InvalidInput):
        TorchPolicy(model).train_step(trajs, adv, AlgorithmConfig(kl_coef=0.1))
    policy = TorchPolicy(model, reference=copy.deepcopy(model))
    metrics = policy.train_step(trajs, adv, AlgorithmConfig(kl_coef=0.1))
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
def test_temperature_matches_engine_scoring(temperature: float) -> None:
    model = build_model(TINY, seed=3)
    trajs, _ = _batch(model, n=3)
    policy = TorchPolicy(model)
    mb = build_microbatches(trajs, [0.0] * 3)[0]
    grid = policy.logprobs(mb, temperature)
    for s in mb.spans:
        expected = torch.tensor(score(model, list(trajs[s.index].token_ids), temperature))
        torch.testing.assert_close(
            grid[s.row, s.start : s.start + s.length - 1], expected, rtol=0, atol=1e-5
        )


def test_state_dict_has_hf_names_on_cpu() -> None:
    model = build_model(TINY, seed=0)
    policy = TorchPolicy(model)
    state = policy.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    fresh = build_model(TINY, seed=9)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_checkpoint_round_trip_restores_everything(tmp_path: Path) -> None:
    model = build_model(TINY, seed=0)
    trajs, adv = _batch(model, n=6)
    policy = TorchPolicy(model, TorchBackendConfig(lr=1e-2))
    for _ in range(2):
        policy.train_step(trajs, adv)
    extra = {"run": "r1", "reward_ema": 0.25, "history": [1, 2]}
    saved = policy.save_checkpoint(
        checkpoint_dir(tmp_path, 2), step=2, weight_version=3, extra=extra
    )
    assert latest_checkpoint(tmp_path) == saved
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]  # no temporary left
    # The model inside is an ordinary HF checkpoint.
    reloaded = load_model(saved / "model")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)

    other = TorchPolicy(build_model(TINY, seed=7), TorchBackendConfig(lr=1e-2))
    assert other.load_checkpoint(saved) == (2, 3, extra)
    for (name, a), b in zip(
        policy.model.state_dict().items(), other.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    sa, sb = policy.optimizer.state_dict(), other.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key, state in sa["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][key][field]))
    # Both continue identically.
    policy.train_step(trajs, adv)
    other.train_step(trajs, adv)
    for a, b in zip(policy.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_checkpoint_and_errors(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    policy = TorchPolicy(build_model(TINY, seed=0))
    for step in (3, 12):
        policy.save_checkpoint(checkpoint_dir(tmp_path, step), step=step, weight_version=step)
    (tmp_path / ".step-00000099.tmp-dead").mkdir()  # an interrupted save
    (tmp_path / "step-00000050").mkdir()  # no state file: incomplete
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-00000012"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["extra"] == {}
    # Saving the same step again replaces it.
    policy.save_checkpoint(latest, step=12, weight_version=13)
    assert policy.load_checkpoint(latest)[1] == 13
    with pytest.raises(NotFound):
        policy.load_checkpoint(tmp_path / "step-00000050")
    with pytest.raises(InvalidInput):
        policy.save_checkpoint(tmp_path / "bad", step=1, weight_version=1, extra={"x": object()})
    assert not (tmp_path / "bad").exists()


def test_train_step_refuses_bad_batches() -> None:
    model = build_model(TINY, seed=0)
    trajs, adv = _batch(model, n=2)
    policy = TorchPolicy(model)
    with pytest.raises(InvalidInput):
        policy.train_step([], [])
    with pytest.raises(InvalidInput):
        policy.train_step(trajs, adv[:1])
    out_of_vocab = dataclasses.replace(trajs[0], token_ids=(999,) * len(trajs[0].token_ids))
    with pytest.raises(InvalidInput):
        policy.train_step([out_of_vocab], [1.0])
