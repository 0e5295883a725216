"""The train loop (docs/architecture.md, "Trainer"): lease a batch → advantages → loss and
step → publish weights → record the step's metrics → checkpoint → acknowledge.
Everything else is a function it calls.

Acknowledgements ride on checkpoints: a batch is acknowledged only after a checkpoint
that includes its step is on disk, and the checkpoint lists the batches it covers. So a
trainer killed at any point loses nothing and trains nothing twice: batches after the
last checkpoint were never acknowledged and come back to the restarted trainer (which
reclaims its predecessor's leases), and the batches of the last checkpoint are
acknowledged again on restart, which counts once.

A step's metrics are recorded (`on_step`) before the checkpoint that covers it, so every
checkpointed step has its row. The rows of steps after the last checkpoint belong to
steps the restarted trainer does again: it drops them when it resumes
(`RunReport.keep_through`), and the gateway replaces a step's row when it is recorded
again, so no step has two.
"""

from __future__ import annotations

import asyncio
import functools
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentflow.errors import AgentFlowError
from agentflow.rollout.stream import TrajectoryStream
from agentflow.types import Trajectory
from trainer.algorithms import AlgorithmConfig, DistillLoss, group_advantages
from trainer.backends.base import Policy
from trainer.backends.torch_backend import checkpoint_dir, latest_checkpoint
from trainer.batching import Advantage, split_valid
from trainer.credit import by_depth_deepest_first, reverse_tree, turn_level_advantages
from trainer.teachers import TeacherError, TeacherManager
from trainer.weights import Publisher


class RunEnded(AgentFlowError):
    """The rollout side stopped or failed while the trainer waited for data."""


@dataclass
class LoopState:
    step: int = 0
    version: int = 0
    unacked: list[list[str]] = field(default_factory=list)  # trained batches' ids


@dataclass
class LoopSettings:
    steps: int
    groups_per_batch: int
    group_size: int
    algorithm: AlgorithmConfig
    normalize_std: bool
    checkpoint_root: Path
    checkpoint_every: int
    keep_checkpoints: int
    max_tokens: int
    pull_timeout_s: float = 5.0
    distill: DistillLoss | None = None  # with teachers: the reverse-KL term
    credit: Literal["trajectory", "turn", "rtpo"] = "trajectory"  # `trainer.credit`
    rtpo_update: Literal["reverse", "joint"] = "reverse"  # `rtpo.update`
    teacher_retry_s: tuple[float, float] = (2.0, 60.0)  # first and longest wait


StepErrorHook = Callable[[int, str], Awaitable[None]]


async def _ignore_error(step: int, error: str) -> None:
    return None


StepHook = Callable[[int, dict[str, float], Sequence[Trajectory]], Awaitable[None]]


async def train(
    policy: Policy,
    stream: TrajectoryStream,
    publisher: Publisher,
    settings: LoopSettings,
    state: LoopState,
    *,
    on_step: StepHook,
    alive: Callable[[], str | None] = lambda: None,
    teachers: TeacherManager | None = None,
    on_error: StepErrorHook = _ignore_error,
) -> LoopState:
    """Run steps until `settings.steps`; `alive()` names why the rollout side ended.

    `on_step(step, metrics, batch)` records each step once its weights are published and
    before the checkpoint that covers it; a trainer that resumes does the steps after its
    checkpoint again, so recording a step twice must leave one record (the last).

    With `teachers`, each batch is scored by them before its step. A teacher that fails
    (`TeacherError`, naming it) fails that step, not the run: `on_error(step, message)`
    hears of it, and the same batch is tried again after a wait that doubles up to
    `settings.teacher_retry_s[1]`; nothing is acknowledged or dropped meanwhile."""
    held: list[Trajectory] | None = None
    failures = 0
    while state.step < settings.steps:
        started = time.perf_counter()
        if held is None:
            batch = await lease_batch(stream, settings, alive)
            valid = await reject_invalid(stream, batch, policy, settings.max_tokens)
        else:
            batch, valid, held = held, held, None
        waited = time.perf_counter() - started
        if not valid:
            continue
        if settings.credit == "rtpo":
            metrics = await asyncio.to_thread(
                rtpo_step,
                policy,
                valid,
                settings.algorithm,
                settings.normalize_std,
                joint=settings.rtpo_update == "joint",
            )
        else:
            advantages: list[Advantage]
            if settings.credit == "turn":
                advantages = list(
                    turn_level_advantages(valid, normalize_std=settings.normalize_std)
                )
            else:
                advantages = list(
                    group_advantages(
                        [t.reward or 0.0 for t in valid],
                        [t.group_id for t in valid],
                        normalize_std=settings.normalize_std,
                    )
                )
            scores = None
            if teachers is not None:
                try:
                    scores = await teachers.score(valid)
                except TeacherError as exc:
                    failures += 1
                    await on_error(state.step + 1, exc.message)
                    first, longest = settings.teacher_retry_s
                    wait = min(longest, first * 2 ** (failures - 1))
                    await asyncio.sleep(random.uniform(0.5, 1.0) * wait)  # jittered
                    held = valid
                    continue
                failures = 0
            metrics = await asyncio.to_thread(
                functools.partial(
                    policy.train_step,
                    valid,
                    advantages,
                    settings.algorithm,
                    teacher=scores,
                    distill=settings.distill if scores is not None else None,
                )
            )
            if scores is not None:
                metrics.update(scores.metrics)
        state.step += 1
        state.version += 1
        sync = await publisher.publish(policy.state_dict(), state.version)
        state.unacked.append([str(t.id) for t in valid])
        metrics.update(
            wait_seconds=waited, sync_seconds=sync.seconds, rejected=len(batch) - len(valid)
        )
        # Before the checkpoint: a trainer killed between the two would otherwise resume
        # after this step with its row never written (its batch acknowledged all the same).
        await on_step(state.step, metrics, valid)
        if state.step % settings.checkpoint_every == 0 or state.step == settings.steps:
            await checkpoint_and_ack(policy, stream, settings, state)
    return state


async def lease_batch(
    stream: TrajectoryStream, settings: LoopSettings, alive: Callable[[], str | None]
) -> list[Trajectory]:
    """`groups_per_batch` whole groups, from as many pulls as it takes."""
    batch: list[Trajectory] = []
    groups: set[object] = set()
    while len(groups) < settings.groups_per_batch:
        ended = alive()
        if ended is not None:
            raise RunEnded(f"the run ended while the trainer waited for data: {ended}")
        want = (settings.groups_per_batch - len(groups)) * settings.group_size
        # All of it at once: the stream looks again only when enough may have ended.
        got = await stream.pull(want, timeout=settings.pull_timeout_s, min_n=want)
        batch += got
        groups.update(t.group_id or t.id for t in got)
    return batch


async def reject_invalid(
    stream: TrajectoryStream, batch: Sequence[Trajectory], policy: Policy, max_tokens: int
) -> list[Trajectory]:
    """Trajectories the trainer cannot use are rejected with the reason, not dropped."""
    valid, rejected = split_valid(batch, max_tokens=max_tokens, vocab_size=policy.vocab_size)
    for trajectory, why in rejected:
        await stream.reject(trajectory.id, trajectory.lease_id, why)
    return valid


async def checkpoint_and_ack(
    policy: Policy, stream: TrajectoryStream, settings: LoopSettings, state: LoopState
) -> None:
    extra = {"unacked": state.unacked}
    directory = checkpoint_dir(settings.checkpoint_root, state.step)
    await asyncio.to_thread(policy.save_checkpoint, directory, state.step, state.version, extra)
    await ack_all(stream, state.unacked)
    state.unacked = []
    _prune(settings.checkpoint_root, settings.keep_checkpoints)


async def ack_all(stream: TrajectoryStream, unacked: Sequence[Sequence[str]]) -> int:
    counted = 0
    for ids in unacked:
        # Each id under the lease it carries now (`lease_id=None`): a batch may come from
        # several pulls. An id acknowledged before counts nothing.
        counted += await stream.ack([uuid.UUID(i) for i in ids], None)
    return counted


async def resume(
    policy: Policy, stream: TrajectoryStream, root: Path
) -> tuple[LoopState, Path | None]:
    """Restore the newest checkpoint under `root` and settle what it covered."""
    await stream.reclaim()
    latest = latest_checkpoint(root)
    if latest is None:
        return LoopState(), None
    step, version, extra = await asyncio.to_thread(policy.load_checkpoint, latest)
    unacked = [[str(i) for i in ids] for ids in extra.get("unacked", [])]
    await ack_all(stream, unacked)
    return LoopState(step=step, version=version), latest


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def summarize_batch(batch: Sequence[Trajectory], version: int) -> dict[str, float]:
    """Rollout-side figures of a trained batch (fresh samples only for the reward), and
    each env's own (`env/<id>/...`): a run whose mix changes while it trains
    (docs/runs.md) shows each env's curve from the step it joined."""
    fresh = [t for t in batch if t.times_served == 0] or list(batch)
    stale = [s for t in batch if (s := t.staleness(version)) is not None]
    turns = [_policy_turns(t) for t in fresh]
    return {
        "reward": sum(t.reward or 0.0 for t in fresh) / len(fresh),
        "turns": sum(turns) / len(turns),
        "episode_tokens": sum(len(t.token_ids) for t in fresh) / len(fresh),
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_max": float(max(stale, default=0)),
        "replayed": float(len(batch) - len([t for t in batch if t.times_served == 0])),
        "trajectories": float(len(batch)),  # a group can be short: an episode failed
        **per_env_figures(batch, version),
    }


def per_env_figures(batch: Sequence[Trajectory], version: int) -> dict[str, float]:
    """For each env of the batch: its mean reward (fresh samples, as `reward`), its
    episodes, and its mean staleness."""
    by_env: dict[str, list[Trajectory]] = {}
    for t in batch:
        if t.env_ref:
            by_env.setdefault(t.env_ref, []).append(t)
    figures: dict[str, float] = {}
    for env, trajectories in sorted(by_env.items()):
        fresh = [t for t in trajectories if t.times_served == 0] or trajectories
        stale = [s for t in trajectories if (s := t.staleness(version)) is not None]
        figures[f"env/{env}/reward"] = sum(t.reward or 0.0 for t in fresh) / len(fresh)
        figures[f"env/{env}/episodes"] = float(len({t.episode_id for t in trajectories}))
        figures[f"env/{env}/staleness"] = sum(stale) / len(stale) if stale else 0.0
    return figures


def rtpo_step(
    policy: Policy,
    batch: Sequence[Trajectory],
    algorithm: AlgorithmConfig,
    normalize_std: bool,
    *,
    joint: bool = False,
) -> dict[str, float]:
    """RTPO's update of one batch (`trainer.credit`): its tree's policy turns, each once
    with its own advantage, one optimizer step per turn depth, deepest first; `joint`
    (`rtpo.update`, an ablation): the same turns and advantages in one step."""
    nodes = reverse_tree(batch, normalize_std=normalize_std)
    depths = by_depth_deepest_first(nodes)
    steps = [[n for level in depths for n in level]] if joint else depths
    merged: dict[str, float] = {}
    for level in steps:
        metrics = policy.train_step(
            [n.sample for n in level], [float(n.advantage or 0.0) for n in level], algorithm
        )
        for key, value in metrics.items():
            merged[key] = merged.get(key, 0.0) + value
    # Sums of the per-depth steps' counts and times; means of their other figures.
    merged.pop("trajectories", None)  # turns, not trajectories: `rtpo_turns` below
    summed = {"seconds", "tokens", "policy_tokens", "microbatches"}
    summed |= {"optimizer_steps", "skipped_steps", "batching_seconds", "no_grad_pass_seconds"}
    out = {k: v if k in summed else v / len(steps) for k, v in merged.items()}
    siblings = Counter(n.sibling_key for n in nodes if n.depth > 0)
    out.update(
        rtpo_turns=float(len(nodes)),
        rtpo_depths=float(len(depths)),
        rtpo_branch_points=float(sum(1 for count in siblings.values() if count > 1)),
    )
    return out


def _policy_turns(trajectory: Trajectory) -> int:
    starts = trajectory.turn_starts
    return sum(1 for s in starts if s < len(trajectory.loss_mask) and trajectory.loss_mask[s])


def pick(metrics: dict[str, Any], *keys: str) -> dict[str, float]:
    return {k: float(metrics[k]) for k in keys if k in metrics}
