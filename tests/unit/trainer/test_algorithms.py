"""The policy loss against an independent PPO-clip, importance weights, clipping, masks,
and GRPO advantages."""

from __future__ import annotations

import math

import pytest
import torch

from agentflow.errors import InvalidInput
from trainer.algorithms import AlgorithmConfig, group_advantages, k3_kl, policy_loss


def _plain_ppo(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps: float
) -> torch.Tensor:
    """Textbook PPO-clip, token mean: -mean(min(r A, clip(r, 1-eps, 1+eps) A))."""
    r = torch.exp(logp - old)
    return -torch.min(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv).mean()


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=g) - 2.0
    adv = torch.randn(n, generator=g)
    return logits, adv


def test_on_policy_decoupled_equals_plain_ppo_loss_and_gradients() -> None:
    base, adv = _data()
    ones = torch.ones_like(base)
    # The decoupled loss with behaviour == proximal == current (detached) log-probs ...
    new = base.clone().requires_grad_(True)
    loss, metrics = policy_loss(new, new.detach(), new.detach(), adv, ones, AlgorithmConfig())
    loss.backward()
    # ... and plain PPO-clip written independently, also on-policy.
    ref = base.clone().requires_grad_(True)
    expected = _plain_ppo(ref, ref.detach(), adv, eps=0.2)
    expected.backward()
    assert torch.equal(loss.detach(), expected.detach())
    assert new.grad is not None and ref.grad is not None
    torch.testing.assert_close(new.grad, ref.grad, rtol=0, atol=1e-7)
    assert metrics["clip_frac"] == 0.0 and metrics["is_weight_dev"] == 0.0
    assert metrics["max_is_weight"] == 1.0 and metrics["approx_kl"] == 0.0


def test_plain_ppo_mode_matches_textbook_off_policy() -> None:
    base, adv = _data(seed=1)
    old = base + 0.3 * torch.randn(base.shape, generator=torch.Generator().manual_seed(2))
    new = base.clone().requires_grad_(True)
    config = AlgorithmConfig(decoupled=False, clip_eps=0.1)
    proximal_ignored = torch.full_like(base, -50.0)
    loss, _ = policy_loss(new, proximal_ignored, old, adv, torch.ones_like(base), config)
    loss.backward()
    ref = base.clone().requires_grad_(True)
    expected = _plain_ppo(ref, old, adv, eps=0.1)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert new.grad is not None and ref.grad is not None
    torch.testing.assert_close(new.grad, ref.grad)


@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_importance_weights_are_truncated_and_carry_no_gradient(tis_cap: float | None) -> None:
    new_values = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    behav = torch.tensor([-1.2, -1.0, -2.0, -3.0])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    # The proximal log-probs have requires_grad: no gradient may reach them through w.
    prox = new_values.clone().requires_grad_(True)
    new = new_values.clone().requires_grad_(True)
    config = AlgorithmConfig(tis_cap=tis_cap)
    loss, metrics = policy_loss(new, prox, behav, adv, torch.ones(4), config)
    loss.backward()
    assert prox.grad is None
    w = torch.exp(new_values - behav)
    used = w if tis_cap is None else w.clamp(max=tis_cap)
    # ratio = 1 at new == prox, so d loss / d logp_new = -w * A / n per token.
    torch.testing.assert_close(new.grad, -used * adv / 4)
    torch.testing.assert_close(loss, -(used * adv).sum() / 4)
    assert metrics["max_is_weight"] == pytest.approx(float(w.max()))
    assert metrics["is_weight_dev"] == pytest.approx(float((w - 1).abs().mean()))
    truncated = 0.0 if tis_cap is None else float((w > tis_cap).float().mean())
    assert metrics["tis_frac"] == pytest.approx(truncated)


def test_clipped_token_with_positive_advantage_gets_no_gradient() -> None:
    prox = torch.tensor([-2.0, -2.0, -2.0])
    # Token 0: ratio e^0.5 > 1.2 with A > 0 (clipped); token 1: ratio 1.1 (inside);
    # token 2: ratio e^0.5 with A < 0 (the unclipped branch is the min: gradient flows).
    new = (prox + torch.tensor([0.5, math.log(1.1), 0.5])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, metrics = policy_loss(new, prox, prox, adv, torch.ones(3), AlgorithmConfig())
    loss.backward()
    assert new.grad is not None
    assert new.grad[0] == 0.0
    assert new.grad[1] != 0.0 and new.grad[2] != 0.0
    assert metrics["clip_frac"] == pytest.approx(1 / 3)


def test_clip_higher_widens_only_the_upper_side() -> None:
    prox = torch.zeros(2) - 1.0
    new = (prox + math.log(1.25)).requires_grad_(True)
    loss, _ = policy_loss(
        new, prox, prox, torch.ones(2), torch.ones(2), AlgorithmConfig(clip_eps_high=0.3)
    )
    loss.backward()
    assert new.grad is not None and bool((new.grad != 0).all())  # 1.25 < 1.3: not clipped


def test_loss_weights_scale_tokens_not_the_denominator() -> None:
    base, adv = _data(n=8)
    weights = torch.tensor([1.0] * 4 + [0.5] * 4)
    full, _ = policy_loss(base, base, base, adv, torch.ones(8), AlgorithmConfig())
    half, _ = policy_loss(base, base, base, adv, weights, AlgorithmConfig())
    expected = -(adv * weights).sum() / 8
    torch.testing.assert_close(half, expected)
    assert not torch.equal(full, half)


def test_normalizer_makes_microbatch_losses_sum_to_the_batch_mean() -> None:
    base, adv = _data(n=10)
    old = base - 0.1
    config = AlgorithmConfig()
    whole, _ = policy_loss(base, old, old, adv, torch.ones(10), config)
    parts = [
        policy_loss(
            base[s], old[s], old[s], adv[s], torch.ones(len(base[s])), config, normalizer=10
        )[0]
        for s in (slice(0, 3), slice(3, 10))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_mask_non_policy_values_do_not_change_the_loss() -> None:
    """Only policy positions reach the loss: whatever sits elsewhere on the grid is ignored."""
    g = torch.Generator().manual_seed(3)
    grid_new, grid_old, grid_adv = (torch.randn(2, 6, generator=g) for _ in range(3))
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)

    def loss_of(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            new[mask],
            old[mask],
            old[mask],
            adv[mask],
            torch.ones(int(mask.sum())),
            AlgorithmConfig(),
        )[0]

    before = loss_of(grid_new, grid_old, grid_adv)
    noise = torch.randn(2, 6, generator=g) * 100 * (~mask)
    after = loss_of(grid_new + noise, grid_old - noise, grid_adv + noise)
    assert torch.equal(before, after)


def test_kl_term_uses_k3_and_needs_reference() -> None:
    base, adv = _data(n=16)
    ref = base - 0.2
    config = AlgorithmConfig(kl_coef=0.5)
    with pytest.raises(InvalidInput):
        policy_loss(base, base, base, adv, torch.ones(16), config)
    with_kl, metrics = policy_loss(base, base, base, adv, torch.ones(16), config, logp_ref=ref)
    without, _ = policy_loss(base, base, base, adv, torch.ones(16), AlgorithmConfig())
    kl = torch.exp(ref - base) - (ref - base) - 1
    torch.testing.assert_close(with_kl - without, 0.5 * kl.mean())
    assert metrics["kl_ref"] == pytest.approx(float(kl.mean()))
    assert float(k3_kl(base, base).abs().max()) == 0.0


def test_empty_or_mismatched_inputs_are_refused() -> None:
    empty = torch.zeros(0)
    with pytest.raises(InvalidInput):
        policy_loss(empty, empty, empty, empty, empty, AlgorithmConfig())
    with pytest.raises(InvalidInput):
        policy_loss(
            torch.zeros(3),
            torch.zeros(3),
            torch.zeros(2),
            torch.zeros(3),
            torch.ones(3),
            AlgorithmConfig(),
        )


def test_group_advantages_known_values() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0]
    groups = ["a", "a", "b", "b", "c", "c", "c"]
    out = group_advantages(rewards, groups, eps=0.0)
    assert out[:2] == pytest.approx([1.0, -1.0])  # mean 0.5, population std 0.5
    assert out[2:4] == [0.0, 0.0]  # zero variance: exactly 0
    std = math.sqrt(((2 - 1) ** 2 + (0 - 1) ** 2 + 0) / 3)
    assert out[4:] == pytest.approx([1 / std, -1 / std, 0.0])
    centred = group_advantages(rewards, groups, normalize_std=False)
    assert centred[:2] == pytest.approx([0.5, -0.5])


def test_group_advantages_singletons_and_ungrouped_get_zero() -> None:
    out = group_advantages([0.1, 0.1, 0.1, 5.0, 3.0], ["x", "x", "x", "solo", None])
    assert out == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert group_advantages([], []) == []


def test_group_advantages_refuse_bad_input() -> None:
    with pytest.raises(InvalidInput):
        group_advantages([1.0], ["a", "b"])
    with pytest.raises(InvalidInput):
        group_advantages([float("nan")], ["a"])
