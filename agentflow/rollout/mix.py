"""Which env the next group comes from: each env's `weight` as its share of groups.

Smooth weighted round-robin (the scheme nginx uses for upstreams): every pick adds each
env's weight to its credit, takes the env with the most credit, and charges it the total.
Over any window each env gets its share to within one group, interleaved, where a random
draw by weight gets it only on average. With four equal envs and four groups per trainer
batch, every batch sees every env; a random draw leaves at least one env out of nine
batches in ten (2.7 envs per batch on average), and a multi-task run's gradient swings
from task to task with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentflow.errors import InvalidInput


class SourceMix:
    """Deterministic picks in proportion to `weights` (any positive numbers)."""

    def __init__(self, weights: Sequence[float]) -> None:
        if not weights:
            raise InvalidInput("a run needs at least one env", field="envs")
        for i, weight in enumerate(weights):
            if not weight > 0:
                raise InvalidInput(
                    f"weight must be > 0, got {weight}", field=("envs", str(i), "weight")
                )
        self.weights = [float(w) for w in weights]
        self.total = sum(self.weights)
        self.credit = [0.0] * len(self.weights)

    def pick(self) -> int:
        """The index of the next env; ties go to the lower index."""
        for i, weight in enumerate(self.weights):
            self.credit[i] += weight
        chosen = max(range(len(self.credit)), key=lambda i: (self.credit[i], -i))
        self.credit[chosen] -= self.total
        return chosen
