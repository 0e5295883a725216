"""Each env's curves in a run's step metrics.

A trainer step records, beside the batch's own figures, each env's (`env/<id>/reward`,
`env/<id>/episodes`, `env/<id>/staleness`: `trainer.loop.per_env_figures`). Grouped by
env, they are the curves of a run whose mix changes while it trains: an env's curve
starts at the step it joined and stops at the one it left. The API (`GET
/v1/runs/{id}/metrics`) and the dashboard's run page serve them, with the mix's
revisions to mark on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "env/"
FIGURES = ("reward", "episodes", "staleness")


def env_curves(
    versions: Iterable[tuple[int, Mapping[str, Any]]],
) -> dict[str, dict[str, list[list[float]]]]:
    """`{env: {figure: [[version, value], ...]}}` from (weight version, step metrics)
    rows in version order; an env id may hold `/` (`agentflow/vault-v0`)."""
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for version, metrics in versions:
        for key, value in metrics.items():
            if not key.startswith(PREFIX) or isinstance(value, bool):
                continue
            env, _, figure = key[len(PREFIX) :].rpartition("/")
            if env and figure in FIGURES and isinstance(value, int | float):
                curves.setdefault(env, {}).setdefault(figure, []).append(
                    [float(version), float(value)]
                )
    return curves
