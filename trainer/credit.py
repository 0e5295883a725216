"""Credit assignment across the turns of multi-turn trajectories (`trainer.algorithm`).

    grpo, ppo    one advantage per trajectory: its reward against its group's
                 (`trainer.algorithms.group_advantages`), on every policy token
    turn_grpo    one advantage per policy turn: the turn's return-to-go (the episode's
                 return less the rewards paid before the turn) against the returns-to-go
                 of the turns at the same position in the group's other trajectories
    rtpo         Reverse-Turn Policy Optimization: the group's trajectories form a sparse
                 reverse tree, continuations re-rolled from chosen turns (the white-box
                 agent's `branches`) sharing everything up to them. Each policy turn's
                 value is the mean return of the trajectories through it; its advantage
                 compares it with its siblings (the turns that answered the same context:
                 re-rolls from the same env turn, or, for first turns, the group's other
                 episodes of the same task). A turn without siblings takes the advantage
                 of its nearest ancestor decision that had some. The update goes in
                 reverse turn order, one optimizer step per turn depth, deepest first, and
                 each turn is trained once (however many continuations share it) on
                 exactly the tokens it was generated after.

Returns-to-go use `Trajectory.turn_rewards` (each env turn holds its step's reward), so a
reward paid at the end counts for every earlier turn, and one paid on the way counts
only for the turns before it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from agentflow.types import Trajectory


@dataclass(frozen=True)
class PolicyTurn:
    """One policy turn of a trajectory: its segment index, token span and position."""

    index: int  # into `turn_ids` / `turn_starts`
    start: int
    end: int
    ordinal: int  # 0 for the trajectory's first policy turn


def policy_turn_spans(trajectory: Trajectory) -> list[PolicyTurn]:
    starts = list(trajectory.turn_starts)
    bounds = [*starts, len(trajectory.token_ids)]
    out: list[PolicyTurn] = []
    for i, start in enumerate(starts):
        end = bounds[i + 1]
        if start < end and any(trajectory.loss_mask[start:end]):
            out.append(PolicyTurn(i, start, end, len(out)))
    return out


def return_to_go(trajectory: Trajectory, turn: PolicyTurn) -> float:
    """The trajectory's reward less what its turns before `turn` were paid."""
    before = sum(trajectory.turn_rewards[: turn.index]) if trajectory.turn_rewards else 0.0
    return float(trajectory.reward or 0.0) - before


def _normalize(values: list[float], *, normalize_std: bool, eps: float = 1e-6) -> list[float]:
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    scale = 1.0
    if normalize_std:
        scale = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values)) + eps
    return [(v - mean) / scale for v in values]


def turn_level_advantages(
    trajectories: Sequence[Trajectory], *, normalize_std: bool = True
) -> list[list[float]]:
    """Per-token advantages (turn-level GRPO): each policy turn's return-to-go against
    the group's turns at the same position; 0 on non-policy tokens."""
    spans = [policy_turn_spans(t) for t in trajectories]
    cells: dict[tuple[Hashable, int], list[tuple[int, PolicyTurn, float]]] = defaultdict(list)
    for i, (t, turns) in enumerate(zip(trajectories, spans, strict=True)):
        group: Hashable = t.group_id if t.group_id is not None else t.id
        for turn in turns:
            cells[(group, turn.ordinal)].append((i, turn, return_to_go(t, turn)))
    out = [[0.0] * len(t.token_ids) for t in trajectories]
    for members in cells.values():
        values = _normalize([g for _, _, g in members], normalize_std=normalize_std)
        for (i, turn, _), advantage in zip(members, values, strict=True):
            out[i][turn.start : turn.end] = [advantage] * (turn.end - turn.start)
    return out


@dataclass
class TreeTurn:
    """A policy turn of a group's tree, once however many trajectories pass through it."""

    turn_id: object
    sibling_key: Hashable
    depth: int  # policy-turn ordinal
    parent_turn: object | None  # the policy turn before it (None: the first)
    sample: Trajectory  # the path up to this turn's end, loss mask on this turn only
    returns: list[float] = dataclasses.field(default_factory=list)
    advantage: float | None = None

    @property
    def value(self) -> float:
        return math.fsum(self.returns) / len(self.returns)


def reverse_tree(
    trajectories: Sequence[Trajectory], *, normalize_std: bool = True
) -> list[TreeTurn]:
    """The batch's policy turns, each once, with its RTPO advantage (module docstring)."""
    turns: dict[object, TreeTurn] = {}
    for t in trajectories:
        group: Hashable = t.group_id if t.group_id is not None else t.id
        previous: object | None = None
        for turn in policy_turn_spans(t):
            turn_id = t.turn_ids[turn.index] if t.turn_ids else (t.id, turn.index)
            node = turns.get(turn_id)
            if node is None:
                parent_id = t.turn_ids[turn.index - 1] if t.turn_ids and turn.index else None
                # First turns answer the task's prompt: the group's episodes are siblings.
                key = (group, "first") if turn.ordinal == 0 else (group, parent_id)
                node = turns[turn_id] = TreeTurn(
                    turn_id=turn_id,
                    sibling_key=key,
                    depth=turn.ordinal,
                    parent_turn=previous,
                    sample=_turn_sample(t, turn),
                )
            node.returns.append(float(t.reward or 0.0))
            previous = turn_id
    siblings: dict[Hashable, list[TreeTurn]] = defaultdict(list)
    for node in turns.values():
        siblings[node.sibling_key].append(node)
    for members in siblings.values():
        if len(members) > 1:
            values = _normalize([m.value for m in members], normalize_std=normalize_std)
            for member, advantage in zip(members, values, strict=True):
                member.advantage = advantage
    # Without siblings, a turn takes its nearest ancestor decision's advantage.
    for node in sorted(turns.values(), key=lambda n: n.depth):
        if node.advantage is None:
            parent = turns.get(node.parent_turn) if node.parent_turn is not None else None
            node.advantage = parent.advantage if parent is not None else 0.0
    return list(turns.values())


def _turn_sample(trajectory: Trajectory, turn: PolicyTurn) -> Trajectory:
    """`trajectory` cut after `turn`, trained on that turn's tokens only: the context it
    was generated after, token for token."""
    end = turn.end
    mask = [0] * end
    mask[turn.start : end] = trajectory.loss_mask[turn.start : end]
    return dataclasses.replace(
        trajectory,
        token_ids=trajectory.token_ids[:end],
        logprobs=trajectory.logprobs[:end],
        loss_mask=tuple(mask),
        weight_versions=trajectory.weight_versions[:end],
        turn_ids=trajectory.turn_ids[: turn.index + 1],
        turn_starts=trajectory.turn_starts[: turn.index + 1],
        turn_rewards=trajectory.turn_rewards[: turn.index + 1],
    )


def by_depth_deepest_first(nodes: Sequence[TreeTurn]) -> list[list[TreeTurn]]:
    """The reverse turn order RTPO updates in: the deepest turns' step first."""
    depths: dict[int, list[TreeTurn]] = defaultdict(list)
    for node in nodes:
        depths[node.depth].append(node)
    return [depths[d] for d in sorted(depths, reverse=True)]
