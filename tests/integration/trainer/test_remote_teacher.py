"""A teacher served by an SGLang worker (the mock worker process, real HTTP on loopback):
its scores are the teacher model's own log-probs, and a teacher engine that does not
answer fails the step with the teacher's name, not the run, and the loop goes on once it
is back."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agentflow.modeling import ModelInit, build_model, score
from agentflow.run_config import DistillConfig, TeacherConfig
from tests.integration.test_serve import _free_port
from tests.integration.trainer.test_weight_sync import _wait_healthy
from tests.support.engine import MockEngine
from tests.unit.trainer.test_loop import MemoryStream
from tests.unit.trainer.test_teachers import relay_trajectory
from trainer.algorithms import AlgorithmConfig, DistillLoss
from trainer.backends.torch_backend import TorchPolicy
from trainer.loop import LoopSettings, LoopState, train
from trainer.teachers import TeacherManager, TeacherScores, TeacherUnavailable, policy_turns
from trainer.weights import WeightPublisher

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
INIT = {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}
ENV = "agentflow/mirror-digits-v0"


@contextmanager
def teacher_worker(port: int, seed: int = 3) -> Iterator[str]:
    """The mock SGLang worker serving `build_model(INIT, seed)`, healthy."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.support.mock_sglang",
            "--port", str(port), "--model-init", json.dumps(INIT), "--seed", str(seed),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _batch(n: int, seed: int = 0) -> list:  # type: ignore[type-arg]
    rng = random.Random(seed)
    return [
        relay_trajectory(
            [f"mirror {rng.randint(100, 999)}", f"right. mirror {rng.randint(100, 999)}"],
            [str(rng.randint(100, 999)), str(rng.randint(100, 999))],
            env_ref=ENV,
        )
        for _ in range(n)
    ]


async def _score_once(url: str, batch: list) -> TeacherScores:  # type: ignore[type-arg]
    manager = _manager(url)
    try:
        return await manager.score(batch)
    finally:
        await manager.close()


def _manager(url: str) -> TeacherManager:
    teacher = TeacherConfig(name="remote", url=url, envs=[ENV])  # type: ignore[arg-type]
    return TeacherManager([teacher], DistillConfig())


def test_a_remote_teacher_scores_the_students_tokens_as_its_model_does() -> None:
    with teacher_worker(_free_port()) as url:
        batch = _batch(3)
        scores = asyncio.run(_score_once(url, batch))
    teacher = build_model(ModelInit.model_validate(INIT), seed=3)
    for trajectory, target in zip(batch, scores.targets, strict=True):
        expected = score(teacher, list(trajectory.token_ids), start=1)
        policy = [k for s, e in policy_turns(trajectory) for k in range(s, e)]
        assert policy
        for k in range(len(trajectory.token_ids)):
            if k in policy:
                assert target.teacher[k] == 0
                assert target.logprobs[k] == pytest.approx(expected[k - 1], abs=1e-4)
            else:
                assert target.teacher[k] == -1
    assert scores.metrics["teacher/remote/tokens_total"] == sum(sum(t.loss_mask) for t in batch)


def test_an_unreachable_teacher_is_named() -> None:
    with pytest.raises(TeacherUnavailable) as caught:
        asyncio.run(_score_once(f"http://127.0.0.1:{_free_port()}", _batch(1)))
    assert "teacher 'remote'" in caught.value.message


async def test_a_teacher_down_fails_the_step_not_the_run(tmp_path: Path) -> None:
    port = _free_port()
    manager = _manager(f"http://127.0.0.1:{port}")
    batch = _batch(8)
    for i, t in enumerate(batch):  # groups of two, rewards that differ
        object.__setattr__(t, "group_id", f"g{i // 2}")
        object.__setattr__(t, "reward", float(i % 2))
    stream = MemoryStream(batch)
    policy = TorchPolicy(build_model(ModelInit.model_validate(INIT), seed=1))
    publisher = WeightPublisher("inprocess", [MockEngine()])
    settings = LoopSettings(
        steps=1,
        groups_per_batch=4,
        group_size=2,
        algorithm=AlgorithmConfig(),
        normalize_std=True,
        checkpoint_root=tmp_path,
        checkpoint_every=1,
        keep_checkpoints=1,
        max_tokens=4096,
        pull_timeout_s=0.0,
        distill=DistillLoss(),
        teacher_retry_s=(0.2, 0.5),
    )
    errors: list[tuple[int, str]] = []
    trained: list[dict[str, float]] = []

    async def on_error(step: int, message: str) -> None:
        errors.append((step, message))

    async def on_step(step: int, metrics: dict[str, float], _: object) -> None:
        trained.append(metrics)

    task = asyncio.create_task(
        train(
            policy, stream, publisher, settings, LoopState(),
            on_step=on_step, teachers=manager, on_error=on_error,
        )
    )  # fmt: skip
    while len(errors) < 2:  # fails, waits, fails again: the run goes on
        assert not task.done(), task
        await asyncio.sleep(0.05)
    assert all(step == 1 and "teacher 'remote'" in said for step, said in errors)
    assert stream.acked == [] and not stream.rejected  # the batch is held, not dropped
    with teacher_worker(port):
        state = await asyncio.wait_for(task, 120)
    await manager.close()
    assert state.step == 1
    assert trained[0]["teacher/remote/tokens"] == sum(sum(t.loss_mask) for t in batch)
    assert sorted(stream.acked) == sorted(t.id for t in batch)  # the very batch it held
