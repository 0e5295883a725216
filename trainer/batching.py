"""Trajectories → micro-batches: validation, layout under a token budget, next-token targets.

A micro-batch is a (rows × width) grid; `rows · width` (padding included: it is what the
forward pass costs) stays within `max_tokens_per_microbatch`. Two layouts:

- `padded`: one trajectory per row, rows of similar length together (sorted, longest
  first), right padding. A causal mask already keeps real tokens from seeing the padding,
  so no attention mask is passed and SDPA keeps its fast `is_causal` kernel.
- `packed`: several trajectories per row (first-fit decreasing into rows of at most
  `max_row_tokens`), positions restarting at 0 for each, and an explicit block-diagonal
  causal mask (rows, 1, width, width) so attention never crosses a trajectory boundary.
  HF Llama takes a 4-D mask as given, which forces SDPA off its `is_causal` path and
  costs attention over the whole row.

Measured on CPU (`bench/train_step.py`, 4 layers × 128, 128 trajectories of 130-270
tokens, rows of 1024): a step takes about 1.4× as long `packed` as `padded`, since
sorting leaves little padding while packing pays for attention across whole rows under a
dense mask; so `padded` is the default. `packed` can win when lengths vary widely, or
with a varlen attention kernel (not used here); both give the same log-probs (tested).

Targets are aligned with the position that predicts them: at row position j holding
token k of a trajectory, `targets[j]` is token k+1, and `loss_mask`, `behaviour_logprobs`,
`advantages` and `loss_weights` are those of token k+1. A trajectory's last position, and
padding, predict nothing (`target_valid` False). A policy token at index 0 has no context
and is never trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import InvalidInput
from agentflow.types import Trajectory

if TYPE_CHECKING:
    import torch

    from trainer.teachers import TeacherTargets


# A trajectory's advantage: one number for every token, or one per token.
Advantage = float | Sequence[float]


class InvalidTrajectory(InvalidInput):
    """A trajectory the trainer cannot train on; the loop rejects it and goes on."""


class BatchingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens_per_microbatch: int = Field(
        default=16384,
        ge=16,
        description="rows × width of one micro-batch, padding included (memory and compute "
        "per forward); a longer trajectory is rejected",
    )
    layout: Literal["padded", "packed"] = Field(
        default="padded", description="one trajectory per row, or several with a block mask"
    )
    max_row_tokens: int = Field(
        default=2048,
        ge=16,
        description="packed: row capacity (attention cost grows with its square)",
    )
    pad_id: int = Field(default=0, ge=0, description="token id on padding (never trained on)")


@dataclass(frozen=True)
class Span:
    """Where trajectory `index` (in the list given to `build_microbatches`) sits."""

    index: int
    row: int
    start: int
    length: int


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass worth of trajectories; every tensor is (rows, width) unless noted."""

    input_ids: torch.Tensor  # long
    position_ids: torch.Tensor  # long, restarting at 0 per trajectory
    attention_mask: torch.Tensor | None  # bool (rows, 1, width, width), True = attend; None: causal
    targets: torch.Tensor  # long: the next token (pad_id where target_valid is False)
    target_valid: torch.Tensor  # bool: this position predicts a token of its trajectory
    loss_mask: torch.Tensor  # bool: ... and that token is a policy token
    behaviour_logprobs: torch.Tensor  # float32, of the target token
    advantages: torch.Tensor  # float32, the target token's advantage (a trajectory's, or its own)
    loss_weights: torch.Tensor  # float32, the trajectory's loss weight on every position
    spans: tuple[Span, ...]
    num_tokens: int  # real (unpadded) tokens
    num_policy_tokens: int  # loss_mask.sum()
    # Distillation (`trainer.teachers`), target-aligned like `behaviour_logprobs`: the
    # scoring teacher's index (-1: none), its log-prob of the target, and with the full
    # estimator the row of `teacher_dist` (its log-softmax there; -1: none).
    teacher_index: torch.Tensor | None = None  # long
    teacher_logprobs: torch.Tensor | None = None  # float32
    teacher_rows: torch.Tensor | None = None  # long
    teacher_dist: torch.Tensor | None = None  # float32 (scored positions, vocab)

    def to(self, device: torch.device | str) -> MicroBatch:
        fields = (
            "input_ids",
            "position_ids",
            "targets",
            "target_valid",
            "loss_mask",
            "behaviour_logprobs",
            "advantages",
            "loss_weights",
        )
        moved = {f: getattr(self, f).to(device, non_blocking=True) for f in fields}
        for optional in ("teacher_index", "teacher_logprobs", "teacher_rows", "teacher_dist"):
            value = getattr(self, optional)
            if value is not None:
                moved[optional] = value.to(device, non_blocking=True)
        mask = self.attention_mask
        return replace(self, attention_mask=None if mask is None else mask.to(device), **moved)

    def policy_values(self, grid: torch.Tensor) -> torch.Tensor:
        """The flat entries of a (rows, width) grid at policy positions, row-major."""
        return grid[self.loss_mask]


def loss_weight(trajectory: Trajectory) -> float:
    """The trajectory's loss weight (< 1 down-weights stale data); 1.0 when it has none."""
    return float(getattr(trajectory, "loss_weight", 1.0))


def validate(
    trajectory: Trajectory, *, max_tokens: int | None = None, vocab_size: int | None = None
) -> None:
    """Raise `InvalidTrajectory` (naming the field) unless the trainer can use `trajectory`."""
    n = len(trajectory.token_ids)
    if n == 0:
        raise InvalidTrajectory("trajectory has no tokens", field="token_ids")
    for name in ("logprobs", "loss_mask", "weight_versions"):
        got = len(getattr(trajectory, name))
        if got != n:
            raise InvalidTrajectory(
                f"{name} has {got} entries but the trajectory has {n} tokens", field=name
            )
    if any(m not in (0, 1) for m in trajectory.loss_mask):
        raise InvalidTrajectory("loss_mask entries must be 0 or 1", field="loss_mask")
    if not any(trajectory.loss_mask[1:]):
        raise InvalidTrajectory(
            "trajectory has no policy tokens to train on (loss_mask is 0 after the first token)",
            field="loss_mask",
        )
    if min(trajectory.token_ids) < 0 or (
        vocab_size is not None and max(trajectory.token_ids) >= vocab_size
    ):
        raise InvalidTrajectory(
            f"token ids must lie in [0, {vocab_size if vocab_size is not None else 'vocab'})",
            field="token_ids",
        )
    if not all(math.isfinite(x) for x in trajectory.logprobs):
        raise InvalidTrajectory("logprobs must be finite", field="logprobs")
    weight = loss_weight(trajectory)
    if not (math.isfinite(weight) and weight >= 0):
        raise InvalidTrajectory(
            f"loss_weight must be finite and >= 0, got {weight}", field="loss_weight"
        )
    if max_tokens is not None and n > max_tokens:
        raise InvalidTrajectory(
            f"trajectory has {n} tokens, more than a micro-batch holds ({max_tokens})",
            field="token_ids",
        )


def split_valid(
    trajectories: Sequence[Trajectory],
    *,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
) -> tuple[list[Trajectory], list[tuple[Trajectory, str]]]:
    """(the usable trajectories, [(rejected trajectory, why)]), order kept."""
    valid: list[Trajectory] = []
    rejected: list[tuple[Trajectory, str]] = []
    for t in trajectories:
        try:
            validate(t, max_tokens=max_tokens, vocab_size=vocab_size)
        except InvalidTrajectory as e:
            rejected.append((t, e.message))
        else:
            valid.append(t)
    return valid, rejected


def _rows_padded(lengths: Sequence[int]) -> list[list[int]]:
    return [[i] for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])]


def _rows_packed(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: each trajectory into the first row with room."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, used in enumerate(fill):
            if used + lengths[i] <= capacity:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    order = sorted(range(len(rows)), key=lambda r: -fill[r])
    return [rows[r] for r in order]


def build_microbatches(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[Advantage],
    config: BatchingConfig | None = None,
    *,
    vocab_size: int | None = None,
    teacher: Sequence[TeacherTargets] | None = None,
) -> list[MicroBatch]:
    """Lay `trajectories` out as micro-batches on the CPU. Each has one advantage: a
    number for all its tokens, or one per token (turn-level credit, `trainer.credit`);
    `teacher`: their teacher scores, one per trajectory (distillation).

    Raises `InvalidTrajectory` for an unusable trajectory (filter with `split_valid`
    first) and `InvalidInput` for a wrong number of advantages or a non-finite one.
    """
    config = config or BatchingConfig()
    if len(advantages) != len(trajectories):
        raise InvalidInput(
            f"{len(advantages)} advantages for {len(trajectories)} trajectories",
            field="advantages",
        )
    for t, a in zip(trajectories, advantages, strict=True):
        values = [a] if isinstance(a, int | float) else list(a)
        if not isinstance(a, int | float) and len(values) != len(t.token_ids):
            raise InvalidInput(
                f"{len(values)} per-token advantages for {len(t.token_ids)} tokens",
                field="advantages",
            )
        if not all(math.isfinite(v) for v in values):
            raise InvalidInput("advantages must be finite", field="advantages")
    if teacher is not None and len(teacher) != len(trajectories):
        raise InvalidInput(
            f"{len(teacher)} teacher scores for {len(trajectories)} trajectories", field="teacher"
        )
    budget = config.max_tokens_per_microbatch
    for t in trajectories:
        validate(t, max_tokens=budget, vocab_size=vocab_size)
    lengths = [len(t.token_ids) for t in trajectories]
    if config.layout == "packed":
        rows = _rows_packed(lengths, min(config.max_row_tokens, budget))
    else:
        rows = _rows_padded(lengths)
    # Rows come longest first, so the first row of a micro-batch sets its width.
    groups: list[list[list[int]]] = []
    width = 0
    for row in rows:
        row_len = sum(lengths[i] for i in row)
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
            width = row_len
    packed = config.layout == "packed"
    return [
        _with_teacher(_assemble(group, trajectories, advantages, config, packed=packed), teacher)
        for group in groups
    ]


def _with_teacher(mb: MicroBatch, teacher: Sequence[TeacherTargets] | None) -> MicroBatch:
    """`mb` with its trajectories' teacher scores laid out on its grid."""
    if teacher is None:
        return mb
    import torch

    shape = mb.input_ids.shape
    index = torch.full(shape, -1, dtype=torch.long)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    full = any(teacher[s.index].rows is not None for s in mb.spans)
    rows = torch.full(shape, -1, dtype=torch.long) if full else None
    dists: list[torch.Tensor] = []
    offset = 0
    for span in mb.spans:
        target = teacher[span.index]
        n = span.length
        if len(target.logprobs) != n or len(target.teacher) != n:
            raise InvalidInput("teacher scores must have one entry per token", field="teacher")
        # Token k is predicted at position k - 1 (see the module docstring).
        at = slice(span.start, span.start + n - 1)
        index[span.row, at] = torch.tensor(target.teacher[1:], dtype=torch.long)
        logprobs[span.row, at] = torch.tensor(target.logprobs[1:], dtype=torch.float32)
        if rows is not None and target.rows is not None and target.dist is not None:
            local = torch.tensor(target.rows[1:], dtype=torch.long)
            rows[span.row, at] = torch.where(local >= 0, local + offset, local)
            dists.append(target.dist)
            offset += int(target.dist.shape[0])
    dist = torch.cat(dists) if dists else None
    if rows is not None and dist is None:
        rows = None
    return replace(
        mb, teacher_index=index, teacher_logprobs=logprobs, teacher_rows=rows, teacher_dist=dist
    )


def _assemble(
    rows: list[list[int]],
    trajectories: Sequence[Trajectory],
    advantages: Sequence[Advantage],
    config: BatchingConfig,
    *,
    packed: bool,
) -> MicroBatch:
    import torch

    width = max(sum(len(trajectories[i].token_ids) for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, config.pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    targets = torch.full(shape, config.pad_id, dtype=torch.long)
    target_valid = torch.zeros(shape, dtype=torch.bool)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    adv = torch.zeros(shape, dtype=torch.float32)
    weights = torch.zeros(shape, dtype=torch.float32)
    segment = torch.full(shape, -1, dtype=torch.long)  # -1: padding
    spans: list[Span] = []
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            t = trajectories[i]
            n = len(t.token_ids)
            end = start + n
            ids = torch.tensor(t.token_ids, dtype=torch.long)
            input_ids[r, start:end] = ids
            position_ids[r, start:end] = torch.arange(n)
            targets[r, start : end - 1] = ids[1:]
            target_valid[r, start : end - 1] = True
            loss_mask[r, start : end - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            behaviour[r, start : end - 1] = torch.tensor(t.logprobs[1:], dtype=torch.float32)
            advantage = advantages[i]
            if isinstance(advantage, int | float):
                adv[r, start:end] = float(advantage)
            else:  # token k's advantage sits where token k is predicted, like its log-prob
                adv[r, start : end - 1] = torch.tensor(list(advantage)[1:], dtype=torch.float32)
            weights[r, start:end] = loss_weight(t)
            segment[r, start:end] = i
            spans.append(Span(index=i, row=r, start=start, length=n))
            start = end
        # Padding continues the last trajectory's positions: a restart at 0 would make HF
        # infer packing from the positions and build a mask for the padded layout.
        last = len(trajectories[row[-1]].token_ids)
        position_ids[r, start:] = torch.arange(last, last + width - start)
    attention_mask = None
    if packed:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = segment[:, :, None] == segment[:, None, :]  # padding pairs with padding
        attention_mask = (same & causal)[:, None, :, :]
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        targets=targets,
        target_valid=target_valid,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=adv,
        loss_weights=weights,
        spans=tuple(spans),
        num_tokens=sum(s.length for s in spans),
        num_policy_tokens=int(loss_mask.sum()),
    )
