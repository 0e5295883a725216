"""A run played by two controller shards (`rollout.controllers = 2`) on real PostgreSQL:
real shard processes, each with its own local engine (the tiny model built from the
run's init), episodes of a scripted env, a trainer that leases from the run's stream and
publishes weights from disk. One shard is killed (`SIGKILL`) mid-run.

Checked: every group is played by one shard and has at most `group_size` episodes;
every episode ends, once, with a final status; the killed shard's live episodes are
aborted with the reason and a new shard takes its place; the staleness gate never lets a
group start past its bound and counts every group (refunds included); the stream serves
every trajectory once, in whole groups, within `max_staleness`; every shard serves each
published version.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.config import Settings
from agentflow.db.models import Episode, Run, Trajectory, Turn
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import InvalidInput
from agentflow.inference.base import WeightUpdate
from agentflow.modeling import ModelInit, build_model, save_model
from agentflow.rollout.manager import RunManager
from agentflow.rollout.shards.coordinator import ShardedRun
from agentflow.run_config import EnvMixChange, RunConfig, shard_config
from tests.integration.rollout.shard_envs import BROKEN_SHARD_ENV, SHARD_ENV, SHARD_ENV_B

pytestmark = pytest.mark.integration

ENV = SHARD_ENV
SHARD_OPTIONS = {"preload": ["tests.integration.rollout.shard_envs"]}
INIT = {"layers": 1, "hidden": 32, "heads": 1, "max_context": 256}
GROUP_SIZE = 2
BATCH = 4  # two groups per trainer step
MAX_STALENESS = 1
EPISODES = 48


def _config(*, delay: float = 0.02, **rollout: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "sharded",
            "model": {"init": INIT},
            "envs": [{"id": ENV, "kwargs": {"delay": delay, "steps": 2}, "max_concurrency": 6}],
            "agent": {"max_new_tokens": 4, "max_turns": 4},
            "rollout": {
                "controllers": 2,
                "group_size": GROUP_SIZE,
                "max_concurrency": 6,
                "max_staleness": MAX_STALENESS,
                "max_episodes": EPISODES,
                **rollout,
            },
            "trainer": {"batch_episodes": BATCH},
            "weights": {"sync": "disk"},
        }
    )


@pytest.fixture
async def manager(pg_database: str) -> AsyncIterator[RunManager]:
    db = create_engine(pg_database)
    turns = TurnTree(session_factory(db))
    settings = Settings(database_url=pg_database, secret_key="shards-test-secret")
    manager = RunManager(turns, RuntimeRegistry(), settings, shard_options=SHARD_OPTIONS)
    try:
        yield manager
    finally:
        await manager.shutdown()
        await db.dispose()


def test_a_shard_gets_its_share_of_episodes_and_servers() -> None:
    config = _config(max_concurrency=7)
    shares = [shard_config(config, i, 3) for i in range(3)]
    assert [s.rollout.max_concurrency for s in shares] == [3, 2, 2]
    assert [s.envs[0].max_concurrency for s in shares] == [2, 2, 2]
    assert all(s.rollout.controllers == 1 for s in shares)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"agent": {"type": "http", "url": "http://127.0.0.1:9/"}}, "calls the gateway back"),
        ({"weights": {"sync": "inprocess"}}, "weights.sync = 'disk'"),
        ({"rollout": {"controllers": 8, "max_concurrency": 4}}, "rollout.max_concurrency"),
        ({"envs": [{"id": ENV, "max_concurrency": 1}]}, "envs.0.max_concurrency"),
    ],
)
def test_what_shards_cannot_share_is_refused_naming_it(change: dict[str, Any], named: str) -> None:
    document = _config().model_dump(mode="json")
    for key, value in change.items():
        if isinstance(value, dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    with pytest.raises(ValueError, match="rollout.controllers") as refused:
        RunConfig.model_validate(document)
    assert named in str(refused.value)


async def test_sharded_runs_are_refused_on_sqlite(sqlite_database: str) -> None:
    db = create_engine(sqlite_database)
    settings = Settings(database_url=sqlite_database, secret_key="shards-test-secret")
    manager = RunManager(TurnTree(session_factory(db)), RuntimeRegistry(), settings)
    try:
        with pytest.raises(InvalidInput, match="SQLite") as refused:
            await manager.create(_config())
        assert refused.value.field == ("rollout", "controllers")
    finally:
        await db.dispose()


async def test_two_shards_play_one_run_and_a_killed_shard_is_recovered(
    manager: RunManager, tmp_path: Path
) -> None:
    # Published weights: the run's own init, written once per version.
    model = build_model(ModelInit.model_validate(INIT), seed=0)
    # Env steps of 0.1 s: an episode seen live is still live when the kill lands, also on
    # a loaded machine (with short ones it may end while the query that saw it returns).
    run_id = await manager.create(_config(delay=0.1))
    run = manager.executors[run_id]
    assert isinstance(run, ShardedRun)
    stream = await manager.stream(run_id)
    gate = run.gate
    assert gate is not None

    served: Counter[uuid.UUID] = Counter()
    staleness: list[int] = []
    gate_checked = 0

    async def watch_gate() -> None:
        nonlocal gate_checked
        while True:
            # Never a group past the bound: admitted <= limit at every moment.
            assert gate.admitted <= gate.limit, (gate.admitted, gate.limit)
            gate_checked += 1
            await asyncio.sleep(0.005)

    async def train() -> None:
        version = 0
        while run.state in ("running", "paused") or await _ready(manager, run_id):
            batch = await stream.pull(BATCH, timeout=1.0)
            if not batch:
                continue
            # Whole groups: every trajectory its group made that is not past the bound (a
            # killed shard's groups may have made fewer than group_size).
            for group, n in Counter(t.group_id for t in batch).items():
                assert n == await _made(manager, run_id, group), group
            for t in batch:
                served[t.id] += 1
                stale = t.staleness(version)
                assert stale is not None
                staleness.append(stale)
            version += 1
            path = save_model(model, tmp_path / f"v{version}")
            await manager.update_weights(run_id, WeightUpdate(path=str(path), version=version))
            await stream.ack([t.id for t in batch], batch[0].lease_id)

    watching = asyncio.create_task(watch_gate())
    training = asyncio.create_task(train())
    try:
        # A pause reaches both shards: their live episodes end, no new one starts.
        async with asyncio.timeout(120):
            while sum(run.counters.by_status.values()) < 6:
                await asyncio.sleep(0.05)
        await run.pause()
        # Each shard tells what its group commits hold (a benchmark sums them).
        writes = await run.shard_writes()
        assert set(writes) == set(run.shard_pids())
        assert sum(sum(w["waits"]["turns"]) for w in writes.values()) > 0
        assert all(set(w["queued"]) >= {"turns", "episode_ends"} for w in writes.values())
        async with asyncio.timeout(30):
            while await _count(manager, run_id, live=True):
                await asyncio.sleep(0.05)
        paused_at = await _count(manager, run_id)
        await asyncio.sleep(1.0)
        assert await _count(manager, run_id) == paused_at
        await run.resume()
        # Kill shard 0 once a few more groups have ended.
        async with asyncio.timeout(120):
            while sum(run.counters.by_status.values()) < 14:
                await asyncio.sleep(0.05)
        victim = run.shards[0]
        assert victim is not None and victim.generation == 0
        async with asyncio.timeout(60):  # while it plays episodes, so some are cut off
            while await _count(manager, run_id, live=True, groups=set(victim.held)) < 2:
                await asyncio.sleep(0.005)
        os.kill(victim.process.pid, signal.SIGKILL)
        held = set(victim.held)
        ended = asyncio.create_task(run.wait())
        await asyncio.wait({ended, training}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        if training.done():
            ended.cancel()
            training.result()  # the trainer's check that failed
        assert ended.done(), f"the run did not finish: {_state(run)}"
        async with asyncio.timeout(60):
            while await _ready(manager, run_id):
                await asyncio.sleep(0.1)
    finally:
        training.cancel()
        watching.cancel()
        results = await asyncio.gather(training, watching, return_exceptions=True)
    for result in results:
        if not isinstance(result, asyncio.CancelledError):
            raise result  # type: ignore[misc]

    assert run.state == "finished"
    assert run.replacements == 1
    replacement = run.shards[0]
    assert replacement is not None and replacement.generation == 1
    sessions = manager.sessions
    async with sessions() as session:
        episodes = (
            (await session.execute(select(Episode).where(Episode.run_id == run_id))).scalars().all()
        )
        trajectories = (
            (await session.execute(select(Trajectory).where(Trajectory.run_id == run_id)))
            .scalars()
            .all()
        )
        status = await session.scalar(select(Run.status).where(Run.id == run_id))
        turns_per_depth = await session.execute(
            select(Turn.episode_id, Turn.depth, func.count())
            .join(Episode, Episode.id == Turn.episode_id)
            .where(Episode.run_id == run_id, Turn.kind == "policy")
            .group_by(Turn.episode_id, Turn.depth)
            .having(func.count() > 1)
        )
        assert turns_per_depth.all() == []  # nothing recorded twice
    assert status == "finished"
    # Every episode ended; the killed shard's live ones as aborted, saying why.
    assert all(e.status in ("completed", "truncated", "failed", "aborted") for e in episodes)
    aborted = [e for e in episodes if e.status == "aborted"]
    assert aborted and all("controller shard 0 died" in (e.error or "") for e in aborted)
    assert {e.group_id for e in aborted} <= held
    assert not [e for e in episodes if e.status == "failed"]
    # Groups whole: one shard each, at most group_size episodes.
    by_group = Counter(e.group_id for e in episodes)
    assert all(n <= GROUP_SIZE for n in by_group.values())
    assert set(by_group) <= set(run.assignments)
    assert len(episodes) <= EPISODES and len(episodes) >= EPISODES - 6
    # One trajectory per completed episode, each served once, within the bound.
    completed = [e for e in episodes if e.status == "completed"]
    assert len(trajectories) == len(completed)
    assert served and max(served.values()) == 1
    assert set(served) <= {t.id for t in trajectories}
    assert staleness and max(staleness) <= MAX_STALENESS
    # The gate counted every group of both shards, refunds included: it holds what a
    # restart would count from the database (groups with a trajectory not dropped stale).
    restored = await manager.runs.restore_point(run_id)
    assert gate.admitted == restored.groups_admitted
    assert gate.taken == restored.groups_taken
    assert gate_checked > 10
    assert run.weight_version == restored.version >= 4


async def _ready(manager: RunManager, run_id: uuid.UUID) -> bool:
    async with manager.sessions() as session:
        count = await session.scalar(
            select(func.count())
            .select_from(Trajectory)
            .where(Trajectory.run_id == run_id, Trajectory.status == "ready")
        )
    return bool(count)


async def _made(manager: RunManager, run_id: uuid.UUID, group_id: str | None) -> int:
    async with manager.sessions() as session:
        count = await session.scalar(
            select(func.count())
            .select_from(Trajectory)
            .join(Episode, Episode.id == Trajectory.episode_id)
            .where(Trajectory.run_id == run_id, Episode.group_id == group_id)
            .where(Trajectory.status != "stale")
        )
    return int(count or 0)


async def _count(
    manager: RunManager, run_id: uuid.UUID, *, live: bool = False, groups: set[str] | None = None
) -> int:
    query = select(func.count()).select_from(Episode).where(Episode.run_id == run_id)
    if live:
        query = query.where(Episode.status == "running")
    if groups is not None:
        query = query.where(Episode.group_id.in_(groups))
    async with manager.sessions() as session:
        return int(await session.scalar(query) or 0)


def _state(run: ShardedRun) -> str:
    gate = run.gate
    shards = [
        f"shard {s.index}.{s.generation}: dead={s.dead} leaving={s.leaving} held={len(s.held)}"
        for s in run.shards
        if s is not None
    ]
    gate_state = "" if gate is None else f"gate {gate.admitted}/{gate.limit} taken {gate.taken}"
    return f"{run.state} {run.counters} {gate_state} {shards}"


async def test_a_stop_reaches_every_shard_and_a_shutdown_leaves_no_shard(
    manager: RunManager,
) -> None:
    stopped_id = await manager.create(_config(max_episodes=None, wait_for_trainer=False))
    halted_id = await manager.create(_config(max_episodes=None, wait_for_trainer=False))
    stopped, halted = manager.executors[stopped_id], manager.executors[halted_id]
    assert isinstance(stopped, ShardedRun) and isinstance(halted, ShardedRun)
    processes = [s.process for run in (stopped, halted) for s in run.shards if s is not None]
    assert len(processes) == 4
    async with asyncio.timeout(60):
        while not (
            await _count(manager, stopped_id, live=True)
            and await _count(manager, halted_id, live=True)
        ):
            await asyncio.sleep(0.01)

    await stopped.stop("stopped by the test")
    assert stopped.state == "stopped"
    assert all(p.returncode == 0 for p in processes[:2])  # each shard exited by itself
    assert await _count(manager, stopped_id, live=True) == 0
    async with manager.sessions() as session:
        status = await session.scalar(select(Run.status).where(Run.id == stopped_id))
        reasons = set(
            (
                await session.scalars(
                    select(Episode.error).where(
                        Episode.run_id == stopped_id, Episode.status == "aborted"
                    )
                )
            ).all()
        )
    assert status == "stopped" and reasons == {"stopped by the test"}

    await manager.shutdown()  # the gateway going down: the run halts, its status kept
    assert all(p.returncode is not None for p in processes)
    assert await _count(manager, halted_id, live=True) == 0
    async with manager.sessions() as session:
        status = await session.scalar(select(Run.status).where(Run.id == halted_id))
    assert status == "running"  # a restart picks it up again
    # Not this session's other gateways on the database, though.
    await manager.runs.set_status(halted_id, "stopped")


async def test_failures_in_a_row_across_shards_fail_the_run(manager: RunManager) -> None:
    config = _config(max_episodes=None, wait_for_trainer=False, max_consecutive_failures=6)
    document = config.model_dump(mode="json")
    document["envs"] = [{"id": BROKEN_SHARD_ENV, "max_concurrency": 6}]
    run_id = await manager.create(RunConfig.model_validate(document))
    run = manager.executors[run_id]
    assert isinstance(run, ShardedRun)
    async with asyncio.timeout(60):
        await run.wait()
    assert run.state == "failed"
    assert run.counters.consecutive_failures >= 6
    assert set(run.assignments.values()) == {0, 1}  # both shards played
    async with manager.sessions() as session:
        stored = (await session.execute(select(Run).where(Run.id == run_id))).scalar_one()
    assert stored.status == "failed" and stored.error is not None
    assert "6 episodes failed in a row" in stored.error and "the env crashed" in stored.error


async def test_a_mix_change_reaches_every_shard(manager: RunManager) -> None:
    run_id = await manager.create(_config(max_episodes=None, wait_for_trainer=False))
    run = manager.executors[run_id]
    assert isinstance(run, ShardedRun)
    async with asyncio.timeout(60):
        while await _count(manager, run_id) < 8:
            await asyncio.sleep(0.01)
    entry = {"id": SHARD_ENV_B, "kwargs": {"delay": 0.02, "steps": 2}, "max_concurrency": 6}
    change = EnvMixChange.model_validate({"envs": [entry]})
    revision = await manager.change_envs(run_id, change, changed_by="test")
    assert revision.revision == 1
    admitted_before = set(run.assignments)  # every group admitted under the old mix is here
    async with asyncio.timeout(60):
        while await _count(manager, run_id) < 2 * (len(admitted_before) + 8):
            await asyncio.sleep(0.02)
    await run.stop("stopped by the test")
    async with manager.sessions() as session:
        rows = (
            await session.execute(
                select(Episode.group_id, Episode.env_ref).where(Episode.run_id == run_id)
            )
        ).all()
    envs_of: dict[str, set[str]] = {}
    for group_id, env_ref in rows:
        envs_of.setdefault(str(group_id), set()).add(env_ref)
    assert all(len(envs) == 1 for envs in envs_of.values())  # groups whole, in one env
    later = set(envs_of) - admitted_before
    assert len(later) >= 8
    assert all(envs_of[g] == {SHARD_ENV_B} for g in later), "a group admitted later played A"
    assert {run.assignments[g] for g in later} == {0, 1}, "both shards play the new env"
