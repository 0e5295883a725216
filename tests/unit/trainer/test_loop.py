"""The train loop around its boundaries: a bad trajectory is rejected with its reason and
training goes on; checkpoints carry the batches they acknowledge; a resume settles them."""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from agentflow.modeling import ModelInit, build_model
from agentflow.types import Trajectory
from tests.support.engine import MockEngine
from tests.unit.trainer.test_batching import make_trajectory
from trainer.algorithms import AlgorithmConfig
from trainer.backends.torch_backend import TorchPolicy, latest_checkpoint
from trainer.loop import LoopSettings, LoopState, RunEnded, resume, summarize_batch, train
from trainer.weights import WeightPublisher

TINY = ModelInit(layers=1, hidden=32, heads=2)


class MemoryStream:
    """An in-memory trajectory stream (the database one is tested in integration)."""

    def __init__(self, trajectories: list[Trajectory]) -> None:
        self.ready = list(trajectories)
        self.leased: dict[uuid.UUID, Trajectory] = {}
        self.acked: list[uuid.UUID] = []
        self.rejected: dict[uuid.UUID, str] = {}
        self.reclaimed = 0

    async def pull(
        self, max_n: int, timeout: float = 0.0, lease_id: str | None = None, min_n: int = 1
    ) -> list[Trajectory]:
        lease = uuid.uuid4().hex
        out = [dataclasses.replace(t, lease_id=lease) for t in self.ready[:max_n]]
        self.ready = self.ready[max_n:]
        self.leased.update((t.id, t) for t in out)
        return out

    async def ack(self, ids: Sequence[uuid.UUID], lease_id: str | None = None) -> int:
        fresh = [i for i in ids if i in self.leased and i not in self.acked]
        self.acked += fresh
        return len(fresh)

    async def reject(self, trajectory_id: uuid.UUID, lease_id: str | None, error: str) -> None:
        self.rejected[trajectory_id] = error

    async def reclaim(self) -> int:
        self.reclaimed += 1
        return 0


def _settings(root: Path, steps: int, every: int = 2) -> LoopSettings:
    return LoopSettings(
        steps=steps,
        groups_per_batch=2,
        group_size=2,
        algorithm=AlgorithmConfig(),
        normalize_std=True,
        checkpoint_root=root,
        checkpoint_every=every,
        keep_checkpoints=2,
        max_tokens=4096,
        pull_timeout_s=0.0,
    )


def _groups(n_groups: int, rng: random.Random) -> list[Trajectory]:
    out = []
    for g in range(n_groups):
        for k in range(2):
            out.append(make_trajectory(24, rng, group=f"g{g}", reward=float(k)))
    return out


async def test_a_malformed_trajectory_is_rejected_and_training_goes_on(tmp_path: Path) -> None:
    rng = random.Random(0)
    good = _groups(4, rng)
    bad = dataclasses.replace(good[0], id=uuid.uuid4(), logprobs=good[0].logprobs[:-1])
    stream = MemoryStream([bad, *good])
    engine = MockEngine()
    policy = TorchPolicy(build_model(TINY, seed=0))
    steps: list[int] = []

    async def on_step(step: int, metrics: dict[str, float], batch: object) -> None:
        steps.append(step)

    state = await train(
        policy,
        stream,
        WeightPublisher("inprocess", [engine]),
        _settings(tmp_path, steps=2),
        LoopState(),
        on_step=on_step,
    )
    assert state.step == 2 and steps == [1, 2] and [u.version for u in engine.updates] == [1, 2]
    assert list(stream.rejected) == [bad.id]
    assert "logprobs" in stream.rejected[bad.id]
    leased_good = set(stream.leased) - {bad.id}
    assert set(stream.acked) == leased_good  # all trained ones, acknowledged at the checkpoint


async def test_checkpoints_carry_unacknowledged_batches_and_resume_settles_them(
    tmp_path: Path,
) -> None:
    rng = random.Random(1)
    stream = MemoryStream(_groups(6, rng))
    policy = TorchPolicy(build_model(TINY, seed=0))
    publisher = WeightPublisher("inprocess", [MockEngine()])

    async def nothing(*_: object) -> None:
        return None

    state = await train(
        policy, stream, publisher, _settings(tmp_path, 3, every=3), LoopState(), on_step=nothing
    )
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and state.unacked == []
    assert len(stream.acked) == 12

    # A restarted trainer: reclaims leases, restores the step, acknowledges again (no-op).
    again = TorchPolicy(build_model(TINY, seed=5))
    restored, where = await resume(again, stream, tmp_path)
    assert where == checkpoint and restored.step == 3 and restored.version == 3
    assert stream.reclaimed == 1 and len(stream.acked) == 12
    for name, tensor in policy.model.state_dict().items():
        assert (again.model.state_dict()[name] == tensor).all(), name


async def test_the_loop_stops_when_the_rollout_side_ended(tmp_path: Path) -> None:
    stream = MemoryStream([])
    policy = TorchPolicy(build_model(TINY, seed=0))

    async def nothing(*_: object) -> None:
        return None

    with pytest.raises(RunEnded, match="failed"):
        await train(
            policy,
            stream,
            WeightPublisher("inprocess", [MockEngine()]),
            _settings(tmp_path, 1),
            LoopState(),
            on_step=nothing,
            alive=lambda: "run is failed: env crashed",
        )


def test_a_batch_summary_counts_the_trajectories_a_short_group_included() -> None:
    rng = random.Random(2)
    full = _groups(1, rng)  # two trajectories, rewards 0 and 1
    short = [make_trajectory(24, rng, group="g-short", reward=1.0)]  # its sibling failed
    summary = summarize_batch([*full, *short], version=0)
    assert summary["trajectories"] == 3.0
    assert summary["reward"] == pytest.approx(2 / 3)


async def test_a_step_is_recorded_before_the_checkpoint_that_covers_it(tmp_path: Path) -> None:
    stream = MemoryStream(_groups(6, random.Random(2)))
    policy = TorchPolicy(build_model(TINY, seed=0))
    seen: list[tuple[int, Path | None, int]] = []

    async def on_step(step: int, metrics: dict[str, float], batch: object) -> None:
        seen.append((step, latest_checkpoint(tmp_path), len(stream.acked)))

    await train(
        policy,
        stream,
        WeightPublisher("inprocess", [MockEngine()]),
        _settings(tmp_path, 3, every=1),
        LoopState(),
        on_step=on_step,
    )
    # Each step's record comes while the newest checkpoint is still the step before's,
    # and before its batch is acknowledged: a trainer killed between the two redoes it.
    assert [(s, c.name if c else None, a) for s, c, a in seen] == [
        (1, None, 0),
        (2, "step-00000001", 4),
        (3, "step-00000002", 8),
    ]
