"""The RL objective: group-normalised advantages and the decoupled PPO-clip policy loss.

Three policies meet in one loss (docs/architecture.md, "Trainer"):

    behaviour  π_behav  the weights that sampled each token (log-probs from the engine;
                        asynchronous rollouts mix several versions in one batch)
    proximal   π_prox   the trainer's weights before this update (no grad)
    current    π_θ      the weights being optimised

Per policy token, with advantage A (AReaL's decoupled PPO):

    r    = exp(log π_θ - log π_prox)                     trust-region ratio
    w    = min(exp(log π_prox - log π_behav), tis_cap)   behaviour importance weight,
                                                          truncated (TIS), no gradient
    loss = -w · min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)  + kl_coef · k3(π_θ, π_ref)

Clipping against the proximal policy keeps the trust region about the current weights no
matter how stale the sample is, while `w` corrects for the data having been drawn by an
older (or numerically different: inference kernels, bf16) policy. Plain PPO is the case
π_prox = π_behav (w = 1): `AlgorithmConfig.decoupled = False`.

Normalisation: a token mean over the *batch's* policy tokens. Every policy token weighs
the same whatever its trajectory's length (DAPO's token-level mean; a per-sequence mean
would let a long trajectory's tokens count for less). Micro-batches divide their sum by
the whole batch's token count, so accumulating their gradients gives exactly the batch
mean. A trajectory's `loss_weight` (< 1 for stale data) scales its tokens' terms but not
the denominator, so down-weighted data really contributes less.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import InvalidInput

if TYPE_CHECKING:
    import torch


class AlgorithmConfig(BaseModel):
    """Knobs of the policy loss; `TrainerConfig` carries the common ones (lr, clip, kl)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(
        default=1.0,
        ge=0,
        description="sampling temperature of the rollouts (agent.temperature): log-probs are "
        "of log_softmax(logits / T) exactly as the engine reports them; 0 means unscaled",
    )
    clip_eps: float = Field(default=0.2, gt=0, le=1.0, description="PPO clip range (low side)")
    clip_eps_high: float | None = Field(
        default=None,
        gt=0,
        le=10.0,
        description="upper clip range (DAPO clip-higher); None: clip_eps",
    )
    decoupled: bool = Field(
        default=True,
        description="ratio against the proximal policy with behaviour importance weights; "
        "False: plain PPO, ratio against the behaviour log-probs",
    )
    tis_cap: float | None = Field(
        default=2.0,
        ge=1.0,
        description="truncate behaviour importance weights at this value (truncated importance "
        "sampling for train/inference mismatch); None: no truncation",
    )
    kl_coef: float = Field(default=0.0, ge=0, description="k3 KL penalty to the reference policy")
    normalize_std: bool = Field(
        default=True, description="GRPO: divide advantages by the group's standard deviation"
    )
    minibatches: int = Field(
        default=1,
        ge=1,
        le=256,
        description="optimizer steps per batch; > 1 splits the batch into mini-batches (PPO)",
    )
    proximal: Literal["auto", "recompute"] = Field(
        default="auto",
        description="auto: with one optimizer step per batch the proximal weights are the "
        "current weights, so the gradient pass's own detached log-probs are reused; "
        "recompute: always run a separate no-grad forward first",
    )
    entropy: bool = Field(default=True, description="report the policy tokens' mean entropy")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable | None],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """GRPO advantages: (r - group mean) / (group std + eps), population std (ddof 0).

    A group of one, a trajectory without a group (`None`) and a group whose rewards are all
    equal get 0: there is nothing to compare against, and a zero-variance group carries no
    signal (its exact 0 avoids float noise such as 0.1 - mean(0.1, 0.1, 0.1) != 0).
    """
    if len(rewards) != len(group_ids):
        raise InvalidInput(
            f"{len(rewards)} rewards but {len(group_ids)} group ids", field="group_ids"
        )
    for r in rewards:
        if not isinstance(r, int | float) or not math.isfinite(r):
            raise InvalidInput(f"rewards must be finite numbers, got {r!r}", field="rewards")
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        if g is not None:
            groups[g].append(i)
    out = [0.0] * len(rewards)
    for members in groups.values():
        values = [float(rewards[i]) for i in members]
        if len(values) < 2 or max(values) == min(values):
            continue
        mean = math.fsum(values) / len(values)
        scale = 1.0
        if normalize_std:
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            scale = std + eps
        for i, v in zip(members, values, strict=True):
            out[i] = (v - mean) / scale
    return out


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref) on samples of π: e^(ref-logp) - (ref-logp) - 1.
    Non-negative, unbiased, low variance (Schulman's "Approximating KL divergence")."""
    import torch

    delta = (logp_ref - logp).clamp(-20.0, 20.0)  # exp overflow guard on wild tokens
    return torch.exp(delta) - delta - 1.0


def policy_loss(
    logp_new: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    config: AlgorithmConfig,
    *,
    normalizer: float | None = None,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO-clip loss over flat per-policy-token tensors (see module docstring).

    All inputs have one entry per policy token of a micro-batch; only `logp_new` carries a
    gradient (the others are detached here whatever the caller passed). `normalizer` is the
    policy-token count of the whole batch (default: this call's count), so that summing
    the losses of a batch's micro-batches gives the batch's token mean. With
    `config.decoupled` False, `logp_prox` is ignored and the ratio is taken against
    `logp_behav`.

    Metrics are means over this call's tokens (except `max_is_weight`): `clip_frac`,
    `is_weight_dev` (mean |w - 1|, before truncation), `max_is_weight`, `tis_frac` (share
    truncated), `kl_ref` (k3 to the reference, when given), `approx_kl` (k3 estimate of
    KL(π_behav ‖ π_θ), how far training has drifted from the data), `tokens`.
    """
    import torch

    n = logp_new.numel()
    if n == 0:
        raise InvalidInput("no policy tokens to train on", field="loss_mask")
    shapes = {t.shape for t in (logp_prox, logp_behav, advantages, loss_weights)}
    if shapes != {logp_new.shape} or (logp_ref is not None and logp_ref.shape != logp_new.shape):
        raise InvalidInput("policy_loss inputs must share one shape", field="logp_new")
    logp_behav = logp_behav.detach().float()
    logp_prox = logp_prox.detach().float() if config.decoupled else logp_behav
    advantages = advantages.detach().float()
    weights = loss_weights.detach().float()
    logp_new = logp_new.float()

    ratio = torch.exp(logp_new - logp_prox)
    clipped = ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    if config.decoupled:
        is_weight = torch.exp(logp_prox - logp_behav)
        used_weight = is_weight if config.tis_cap is None else is_weight.clamp(max=config.tis_cap)
    else:
        is_weight = used_weight = torch.ones_like(ratio)
    per_token = -used_weight * surrogate
    kl_ref = None
    if config.kl_coef > 0:
        if logp_ref is None:
            raise InvalidInput("kl_coef > 0 needs reference log-probs", field="kl_coef")
        kl_ref = k3_kl(logp_new, logp_ref.detach().float())
        per_token = per_token + config.kl_coef * kl_ref
    denominator = float(n if normalizer is None else normalizer)
    loss = (per_token * weights).sum() / denominator

    with torch.no_grad():
        high = (advantages > 0) & (ratio > 1.0 + config.clip_high)
        low = (advantages < 0) & (ratio < 1.0 - config.clip_eps)
        metrics = {
            "clip_frac": float((high | low).float().mean()),
            "is_weight_dev": float((is_weight - 1.0).abs().mean()),
            "max_is_weight": float(is_weight.max()),
            "tis_frac": float((is_weight > config.tis_cap).float().mean())
            if config.tis_cap is not None and config.decoupled
            else 0.0,
            "approx_kl": float(k3_kl(logp_behav, logp_new.detach()).mean()),
            "tokens": float(n),
        }
        if kl_ref is not None:
            metrics["kl_ref"] = float(kl_ref.mean())
    return loss, metrics


class DistillLoss(BaseModel):
    """The reverse-KL term of on-policy distillation (`trainer.teachers`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coef: float = Field(default=1.0, gt=0, description="weight of the reverse-KL term")
    rl: bool = Field(default=True, description="keep the RL advantages; False: distil alone")
    estimator: Literal["sampled", "full"] = Field(
        default="sampled",
        description="sampled: -coef·(log π_θ - log π_T) of each sampled token joins its "
        "advantage (a policy-gradient estimate of the reverse KL, under the PPO clip); "
        "full: coef·KL(π_θ ‖ π_T) over the whole vocabulary at each sampled position, "
        "differentiated exactly",
    )


def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(π_θ ‖ π_T) at each position, exactly, from both log-softmaxes over the vocabulary
    (last dimension): Σ_v π_θ(v) (log π_θ(v) - log π_T(v))."""
    return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)


def distill_terms(
    distill: DistillLoss,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mb: Any,
    *,
    student_full: torch.Tensor | None,
    normalizer: float,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[tuple[int, str], float]]:
    """(per-token advantages, the full estimator's loss term or None, KL sums per teacher).

    Per policy token scored by a teacher (`mb.teacher_index` >= 0), the reverse KL
    KL(π_θ ‖ π_T) at that position is estimated as:
      sampled: log π_θ(x) - log π_T(x) on the sampled x (unbiased for the KL, k1);
               its negative, times `coef`, is added to the token's advantage, so the PPO
               loss descends it like a per-token reward;
      full:    Σ_v π_θ(v) (log π_θ(v) - log π_T(v)), exact; added to the loss as a token
               mean over the batch (the PPO loss's own normaliser), times `coef`.
    Unscored tokens (a turn no teacher covers) carry no KL term. Without `distill.rl`
    the RL advantages are dropped: the student learns from its teachers alone.
    """
    import torch

    assert mb.teacher_index is not None and mb.teacher_logprobs is not None
    index = mb.policy_values(mb.teacher_index)
    scored = index >= 0
    advantages = advantages if distill.rl else torch.zeros_like(advantages)
    kl_loss = None
    if distill.estimator == "sampled":
        teacher_lp = mb.policy_values(mb.teacher_logprobs)
        kl = torch.where(scored, logp.detach().float() - teacher_lp, torch.zeros_like(teacher_lp))
        advantages = advantages - distill.coef * kl
    else:
        if student_full is None or mb.teacher_rows is None or mb.teacher_dist is None:
            raise InvalidInput(
                "the full estimator needs the teachers' distributions", field="estimator"
            )
        rows = mb.policy_values(mb.teacher_rows)
        teacher_logp = mb.teacher_dist[rows.clamp(min=0)]
        per_token = reverse_kl(student_full, teacher_logp)
        per_token = torch.where(rows >= 0, per_token, torch.zeros_like(per_token))
        kl_loss = distill.coef * (per_token * weights.float()).sum() / float(normalizer)
        kl = per_token.detach()
    sums: dict[tuple[int, str], float] = {}
    for teacher in index[scored].unique().tolist():
        mine = index == teacher
        sums[(int(teacher), "kl")] = float(kl[mine].sum())
        sums[(int(teacher), "tokens")] = float(mine.sum())
    return advantages, kl_loss, sums


def teacher_metrics(names: Sequence[str], sums: dict[tuple[int, str], float]) -> dict[str, float]:
    """`teacher/NAME/kl` (mean reverse KL on its tokens) and `teacher/NAME/tokens`."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        tokens = sums.get((i, "tokens"), 0.0)
        out[f"teacher/{name}/tokens"] = tokens
        if tokens:
            out[f"teacher/{name}/kl"] = sums.get((i, "kl"), 0.0) / tokens
    return out
