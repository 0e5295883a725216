"""`Policy`: what the train loop, the ranks and the publishers ask of a trainer backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentflow.types import Trajectory
from trainer.batching import Advantage, MicroBatch

if TYPE_CHECKING:
    import torch

    from trainer.algorithms import AlgorithmConfig, DistillLoss
    from trainer.teachers import TeacherScores


class Policy(Protocol):
    """The trained policy of one rank (`TorchPolicy`, `MegatronPolicy`)."""

    # The HF model: its config and tokenizer for checkpoints and publishers (and, for the
    # torch backend, the weights it trains).
    model: Any
    vocab_size: int
    data_rank: int  # which share of a batch this rank trains (trainer/ranks.py)
    data_ranks: int

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[Advantage],
        algorithm: AlgorithmConfig | None = None,
        *,
        teacher: TeacherScores | None = None,
        distill: DistillLoss | None = None,
        idle: bool = False,
    ) -> dict[str, float]: ...

    def logprobs(self, microbatch: MicroBatch, temperature: float = 1.0) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def save_checkpoint(
        self,
        directory: str | Path,
        step: int,
        weight_version: int,
        extra: dict[str, Any] | None = None,
    ) -> Path: ...

    def load_checkpoint(self, directory: str | Path) -> tuple[int, int, dict[str, Any]]: ...
