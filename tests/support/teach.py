"""A tiny model taught one answer: a few hundred steps of teacher forcing on one
sequence, so an engine serving it answers that prompt with that target (greedy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentflow.modeling import ModelInit


def teach(init: ModelInit, prompt: Sequence[int], target: Sequence[int], steps: int = 300) -> Any:
    """A model built from `init` (seed 0) trained until `target` follows `prompt`."""
    import torch

    from agentflow.modeling import build_model

    torch.manual_seed(0)
    model = build_model(init, seed=0)
    ids = torch.tensor([[*prompt, *target]])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.02:
            break
    return model.eval()
