"""`EnvLanes`: the envs a run's scheduler plays, and the mix its next groups come from.

Each env of the mix is a lane: how to make its envs (`EnvSource`), its reward function,
and its own cap on live episodes. A group is admitted to a lane by key and plays there to
its end, so a mix that changes while the run trains (`PATCH /v1/runs/{id}`) changes only
which lanes the next groups go to: a lane that leaves the mix stays until the run ends,
for the groups admitted to it before, and an env changed only in weight or cap keeps its
lane (its cap applies to the episodes it starts next). The key is the env with what
decides how its episodes play: its id, kwargs and reward function. A controller shard
keys its lanes the same way, so a ticket names the same env in every process.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentflow.plugins import load_function
from agentflow.rollout.elastic import ElasticLimit
from agentflow.rollout.envs import EnvSource
from agentflow.run_config import EnvEntry


def lane_key(entry: EnvEntry) -> str:
    return json.dumps([entry.id, entry.kwargs, entry.reward], sort_keys=True, separators=(",", ":"))


@dataclass
class EnvLane:
    key: str
    entry: EnvEntry
    source: EnvSource
    reward: Callable[..., Any] | None
    slots: ElasticLimit  # the env's own cap on live episodes


@dataclass(frozen=True)
class LanePlan:
    """A mix, checked and ready to switch to (`EnvLanes.apply` cannot fail)."""

    entries: tuple[EnvEntry, ...]
    sources: tuple[EnvSource, ...]
    new: dict[str, EnvLane]


class EnvLanes:
    def __init__(self, entries: Sequence[EnvEntry], sources: Sequence[EnvSource]) -> None:
        self.lanes: dict[str, EnvLane] = {}
        self.mix: list[tuple[str, float]] = []  # (lane key, weight), in the mix's order
        self.apply(self.prepare(entries, sources))

    def prepare(self, entries: Sequence[EnvEntry], sources: Sequence[EnvSource]) -> LanePlan:
        """What can fail (a reward function that does not load) is done here, before the
        mix in effect changes. `sources` are `entries` resolved, in order."""
        if len(entries) != len(sources):
            raise ValueError(f"{len(entries)} env entries but {len(sources)} sources")
        new: dict[str, EnvLane] = {}
        for i, (entry, source) in enumerate(zip(entries, sources, strict=True)):
            key = lane_key(entry)
            if key in self.lanes or key in new:
                continue
            reward = (
                None
                if entry.reward is None
                else load_function(entry.reward, field=("envs", str(i), "reward"))
            )
            new[key] = EnvLane(key, entry, source, reward, ElasticLimit(source.max_concurrency))
        return LanePlan(tuple(entries), tuple(sources), new)

    def apply(self, plan: LanePlan) -> None:
        """Switch to `plan`'s mix: new lanes open, kept ones take their new cap."""
        self.lanes.update(plan.new)
        mix: list[tuple[str, float]] = []
        for entry, source in zip(plan.entries, plan.sources, strict=True):
            lane = self.lanes[lane_key(entry)]
            lane.entry, lane.source = entry, source
            lane.slots.set_limit(source.max_concurrency)
            mix.append((lane.key, entry.weight))
        self.mix = mix

    def __getitem__(self, key: str) -> EnvLane:
        return self.lanes[key]
