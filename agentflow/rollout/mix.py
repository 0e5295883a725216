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

from pydantic import ValidationError

from agentflow.errors import InvalidInput
from agentflow.run_config import EnvEntry, EnvMixChange


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


def revise_mix(entries: Sequence[EnvEntry], change: EnvMixChange) -> list[EnvEntry]:
    """The mix `change` makes of `entries`: its `envs`, or `entries` with its `set`
    applied (in place, or appended) and then its `remove`. A refusal names the field of
    `change` it is about."""
    if change.envs is not None:
        return list(change.envs)
    present = {e.id for e in entries}
    result = list(entries)
    for i, patch in enumerate(change.set):
        where = ("set", str(i))
        if patch.id in change.remove:
            raise InvalidInput(f"{patch.id!r} is both set and removed", field=(*where, "id"))
        found = [j for j, e in enumerate(result) if e.id == patch.id]
        if len(found) > 1:
            raise InvalidInput(
                f"{patch.id!r} is in the mix {len(found)} times: send the whole mix as envs",
                field=(*where, "id"),
            )
        fields = patch.model_dump(exclude_none=True)
        if found:
            fields = {**result[found[0]].model_dump(), **fields}
        try:
            entry = EnvEntry.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise InvalidInput(
                error["msg"], field=(*where, *(str(p) for p in error["loc"]))
            ) from None
        if found:
            result[found[0]] = entry
        else:
            result.append(entry)
    for i, env_id in enumerate(change.remove):
        if env_id not in present:
            raise InvalidInput(f"{env_id!r} is not in the run's mix", field=("remove", str(i)))
        result = [e for e in result if e.id != env_id]
    if not result:
        raise InvalidInput("a run needs at least one env: this removes them all", field="remove")
    return result


def blame(
    change: EnvMixChange, entries: Sequence[EnvEntry], field: tuple[str, ...]
) -> tuple[str, ...]:
    """The field of `change` that a refusal of its mix `entries` at `field` (`envs.i...`)
    is about: `set.j...` when the entry came from edit j."""
    if change.envs is not None or len(field) < 2 or field[0] != "envs":
        return field
    try:
        entry = entries[int(field[1])]
    except (ValueError, IndexError):
        return field
    for j, patch in enumerate(change.set):
        if patch.id == entry.id:
            return ("set", str(j), *field[2:])
    return field
