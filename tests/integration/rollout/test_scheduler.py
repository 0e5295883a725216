"""The rollout scheduler (`RunExecutor`) on a real database: the staleness gate, refunds,
caps under a burst, and the elastic pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db.models import Run
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import SamplingParams, WeightUpdate
from agentflow.rollout.elastic import ElasticLimit, ElasticPool
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.executor import RunExecutor
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import RunConfig
from agentflow.tokenization.chat import ByteChatTemplate
from envs import registry
from tests.integration.rollout.scripted_envs import BrokenEnv, HangingEnv, SlowEnv
from tests.support.engine import MockEngine

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def scripted_envs() -> Iterator[None]:
    registry.register("test/Slow-v0", SlowEnv, replace=True)
    registry.register("test/Broken-v0", BrokenEnv, replace=True)
    registry.register("test/Hanging-v0", HangingEnv, replace=True)
    SlowEnv.live = SlowEnv.peak = 0
    yield
    for env_id in ("test/Slow-v0", "test/Broken-v0", "test/Hanging-v0"):
        registry.unregister(env_id)


def _config(**rollout: Any) -> RunConfig:
    trainer = {"batch_episodes": rollout.pop("batch_episodes", 4)}
    env_cap = rollout.pop("env_cap", 64)
    return RunConfig.model_validate(
        {
            "name": "scheduler-test",
            "envs": [{"id": "test/Slow-v0", "max_concurrency": env_cap}],
            "rollout": {"group_size": 2, **rollout},
            "trainer": trainer,
        }
    )


@pytest.fixture
async def executor_for(
    turn_tree: TurnTree,
) -> AsyncIterator[Any]:
    made: list[RunExecutor] = []

    async def make(
        config: RunConfig,
        env: str = "test/Slow-v0",
        delay: float = 0.0,
        step_timeout_s: float | None = None,
        **env_kwargs: Any,
    ) -> RunExecutor:
        async with turn_tree.sessions.begin() as session:
            run = Run(name=config.name, config=config.model_dump(mode="json"), status="pending")
            session.add(run)
            await session.flush()
            run_id = run.id
        # Answers at once ("7" then the stop id): these tests are about admission.
        engine = MockEngine(delay_s=delay, extra={"max_batch_size": 8})
        template = ByteChatTemplate()
        runtime = PolicyRuntime(
            engine,
            template,
            sampling=SamplingParams(max_new_tokens=4, stop_token_ids=template.stop_ids),
            partial_rollout=config.rollout.partial_rollout,
        )
        entry = config.envs[0]
        source = EnvSource(
            ref=env,
            weight=1.0,
            max_concurrency=entry.max_concurrency,
            step_timeout_s=step_timeout_s,
            kwargs={"delay": 0.01, "steps": 2, **env_kwargs},
        )
        executor = RunExecutor(
            run_id,
            config,
            turns=turn_tree,
            runtime=runtime,
            sources=[source],
            agent=WhiteBoxAgent(park_after_s=None, step_grace_s=0.05),
            gateway_url="http://unused",
            secret_key="k",
        )
        made.append(executor)
        await executor.start()
        return executor

    yield make
    for executor in made:
        await executor.stop()


async def _settle(executor: RunExecutor, started: int, timeout: float = 30.0) -> None:
    """Wait until `started` episodes started and none is live."""
    async with asyncio.timeout(timeout):
        while executor.counters.started < started or executor._live:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # nothing more is admitted


def _stream(turns: TurnTree, executor: RunExecutor, **kw: Any) -> DbTrajectoryStream:
    """The run's stream, wired to its gate, with a short poll for the test."""
    stream = executor.trajectory_stream()
    stream.poll_s = 0.05
    for name, value in kw.items():
        setattr(stream, name, value)
    return stream


async def test_the_gate_admits_max_staleness_plus_one_batches_ahead(
    executor_for: Any, turn_tree: TurnTree
) -> None:
    config = _config(max_staleness=1, batch_episodes=4)  # 2 groups of 2 per batch
    executor = await executor_for(config)
    stream = _stream(turn_tree, executor)
    await _settle(executor, 8)
    assert executor.counters.started == 8  # (0 + 1 + 1) batches of 4
    # A trainer step: take one batch (nothing opens yet), then publish version 1.
    batch = await stream.pull(4, timeout=5)
    await asyncio.sleep(0.1)
    assert executor.counters.started == 8
    await executor.update_weights(WeightUpdate(state_dict={}, version=1))
    await stream.ack([t.id for t in batch], batch[0].lease_id)
    await _settle(executor, 12)
    assert executor.counters.started == 12
    assert executor.weight_version == 1


async def test_a_trainer_never_sees_tokens_older_than_the_bound(
    executor_for: Any, turn_tree: TurnTree
) -> None:
    config = _config(max_staleness=1, batch_episodes=4, max_episodes=40)
    executor = await executor_for(config, delay=0.005)
    stream = _stream(turn_tree, executor, max_staleness=1)
    version, seen = 0, []
    while version < 8:
        batch: list[Any] = []
        async with asyncio.timeout(30):
            while len(batch) < 4:
                batch += await stream.pull(4 - len(batch), timeout=5)
        seen += [t.staleness(version) for t in batch]
        await asyncio.sleep(0.02)  # "train"
        version = await executor.update_weights(WeightUpdate(state_dict={}))
        await stream.ack([t.id for t in batch])  # several pulls: each under its own lease
    # Episodes end out of admission order, so a group admitted early can be overtaken
    # and age past the bound before it ends: the stream drops it then (the gate only
    # bounds admission). What holds every time: nothing older reaches the trainer.
    assert len(seen) == 32 and max(s for s in seen if s is not None) <= 1
    assert stream.counters.served_fresh == 32


async def test_the_gate_alone_keeps_a_lockstep_trainer_inside_the_bound(
    executor_for: Any, turn_tree: TurnTree
) -> None:
    # The trainer pulls only once every admitted episode has ended, so nothing is
    # overtaken: the gate's bound and the oldest-policy-first order leave nothing to drop.
    config = _config(max_staleness=1, batch_episodes=4, max_episodes=40)
    executor = await executor_for(config)
    stream = _stream(turn_tree, executor, max_staleness=1)
    version, seen = 0, []
    while version < 8:
        await _settle(executor, min(40, (version + 2) * 4))
        batch: list[Any] = []
        async with asyncio.timeout(30):
            while len(batch) < 4:
                batch += await stream.pull(4 - len(batch), timeout=5)
        seen += [t.staleness(version) for t in batch]
        version = await executor.update_weights(WeightUpdate(state_dict={}))
        await stream.ack([t.id for t in batch])
    assert seen == [0] * 4 + [1] * 28
    assert stream.counters.dropped_stale == 0


async def test_a_group_that_yields_nothing_is_refunded(executor_for: Any) -> None:
    config = _config(max_staleness=0, batch_episodes=4)
    executor = await executor_for(config, env="test/Broken-v0")
    await _settle(executor, 12)  # failed groups do not hold the gate shut
    assert executor.gate is not None and executor.gate.refunded >= 4
    assert executor.counters.by_status.get("failed", 0) >= 12


async def test_caps_hold_under_a_burst_of_a_thousand_queued_tasks(
    executor_for: Any, database_url: str
) -> None:
    if database_url.startswith("sqlite"):
        pytest.skip("one database is enough for the caps; SQLite would only make it slow")
    config = _config(
        wait_for_trainer=False, max_episodes=1000, max_concurrency=24, env_cap=16, group_size=8
    )
    executor = await executor_for(config, delay=0.001, steps=1)
    await _settle(executor, 1000, timeout=120)
    assert executor.counters.by_status == {"completed": 1000}
    assert SlowEnv.peak <= 16  # the env's own cap
    assert executor._slots.held == 0


async def test_the_elastic_pool_follows_measured_load() -> None:
    limit = ElasticLimit(8)
    measured = {"generating": 2.0, "waiting": 0}

    async def engine_slots() -> tuple[int, int]:
        return 8, measured["waiting"]

    pool = ElasticPool(
        limit,
        min_concurrency=4,
        max_concurrency=64,
        engine_slots=engine_slots,
        generating=lambda: measured["generating"],
    )
    limit.held = 8  # 8 live episodes, 2 of them generating: the engine is underfed
    for _ in range(8):
        await pool.tick()
    assert 28 <= limit.limit <= 32  # toward 8 slots / (2 / 8) = 32
    measured["waiting"] = 3  # the engine queues requests: do not raise further
    limit.held = 32
    measured["generating"] = 2.0
    before = limit.limit
    await pool.tick()
    assert limit.limit <= before
    measured.update(generating=32.0, waiting=0)  # everybody generates: shrink to the slots
    for _ in range(10):
        await pool.tick()
    assert limit.limit == 8
    pool.max_concurrency = 6
    await pool.tick()
    assert limit.limit == 6  # never past the caps


async def test_an_elastic_run_keeps_its_caps(executor_for: Any) -> None:
    config = _config(
        wait_for_trainer=False, max_episodes=60, elastic=True, min_concurrency=2, max_concurrency=12
    )
    executor = await executor_for(config, delay=0.002)
    assert executor.pool is not None
    executor.pool.interval_s = 0.02
    await _settle(executor, 60)
    assert executor.counters.by_status == {"completed": 60}
    assert all(2 <= n <= 12 for n in executor.pool.history)


async def test_an_env_that_hangs_fails_its_episodes_not_the_run(executor_for: Any) -> None:
    config = _config(wait_for_trainer=False, max_episodes=4, max_concurrency=4)
    executor = await executor_for(config, env="test/Hanging-v0", step_timeout_s=0.1)
    await _settle(executor, 4, timeout=20)
    assert executor.counters.by_status == {"failed": 4}
    assert "did not answer a step within 0.1 s" in (executor.counters.last_error or "")
    assert executor.state == "finished"  # the run itself ends normally
    assert SlowEnv.live == 0  # every hung env was closed
