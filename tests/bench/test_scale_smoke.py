"""`bench/scale.py` at a tiny size: the real controller plays, records and streams against
the simulated engines, env and trainer, and the report has a row per level. Also the
simulated engine's protocol edges: version spans, stop tokens, aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from agentflow.db import migrate
from agentflow.db.session import create_engine
from agentflow.db.turn_sql import episodes as episodes_table
from agentflow.db.turn_sql import turns as turns_table
from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef, WeightUpdate
from agentflow.inference.pool import EnginePool
from bench.scale import (
    Workload,
    on_loop,
    report,
    run,
    run_sharded_level,
    sharded_report,
    verdict,
)
from bench.scale_sim import ENV_ID, EngineModel, SimEngine, register_env
from envs import registry

STOP = 263  # the byte tokenizer's <|end|>
TINY = Workload(
    engines=2,
    engine=EngineModel(slots=8, prefill_s=0.002, per_token_s=0.0005, length_median=16),
    env_latency_s=0.005,
    group_size=4,
    train_s=0.05,
)


@pytest.fixture
def registered() -> Iterator[None]:
    register_env()
    yield
    registry.unregister(ENV_ID)


async def _stored(url: str) -> tuple[dict[str, int], int]:
    db = create_engine(url)
    async with db.connect() as conn:
        kinds = await conn.execute(
            select(turns_table.c.kind, func.count()).group_by(turns_table.c.kind)
        )
        by_kind = {str(kind): int(n) for kind, n in kinds}
        runs = await conn.scalar(select(func.count(func.distinct(episodes_table.c.run_id))))
    await db.dispose()
    return by_kind, int(runs or 0)


def test_a_tiny_run_records_streams_and_reports(tmp_path: Path, registered: None) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'scale.db'}"
    migrate.upgrade(url)
    results = [
        run(level, TINY, url, warmup_s=0.5, seconds=2.0, max_warmup_s=5.0, timeout_s=120)
        for level in (10, 20)
    ]

    for r in results:
        assert r.played > 0 and r.cpu_s > 0
        assert r.rows.get("policy", 0) > 0 and r.rows.get("env", 0) > 0
        assert r.trajectories_created > 0 and r.consumed > 0
        assert r.versions > 0  # the trainer published, through the engine pool
        assert sum(r.staleness.values()) == r.consumed
        assert r.logged == {} and "failed" not in r.statuses
        assert r.statements["INSERT turns"] > 0 and r.statements["UPDATE episodes"] > 0
    by_kind, runs = asyncio.run(_stored(url))
    assert runs == 2 and by_kind["prompt"] > 0 and by_kind["policy"] >= by_kind["env"] > 0

    lines = report(results)
    assert lines[2].startswith("| 10 |") and lines[3].startswith("| 20 |")
    assert any(line.startswith("| 10 → 20 | x2 |") for line in lines)
    assert "concurrent episodes" in verdict(results)


@pytest.mark.integration
def test_a_tiny_sharded_level_plays_in_shard_processes_and_reports(
    pg_database: str, registered: None
) -> None:
    """`--controllers`: the shards (processes with their share of the simulated engines)
    play, the coordinator's trainer publishes through every shard, and the CPU counted is
    that of every controller process."""
    results = [
        on_loop(
            "asyncio",
            run_sharded_level(
                16, count, TINY, pg_database, warmup_s=0.5, seconds=2.0, max_warmup_s=10.0
            ),
            timeout_s=120,
        )
        for count in (1, 2)
    ]
    for r in results:
        assert r.played > 0 and r.consumed > 0
        assert r.shard_cpu_s > 0 and r.cpu_s > r.shard_cpu_s  # shards' and the coordinator's
        assert r.logged == {} and r.replaced == 0
        assert max(r.staleness) <= r.max_staleness
        assert r.queued_turns and sum(r.write_waits["turns"]) > 0  # the shards' queues
    lines = sharded_report(results)
    assert lines[2].startswith("| 16 | 1 |") and lines[3].startswith("| 16 | 2 |")
    assert "16 episodes, 2 shards against 1: CPU per turn x" in lines[-1]


def _request(session_id: str, parent: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        input_ids=(1, 2, 3),
        sampling=SamplingParams(max_new_tokens=400, stop_token_ids=(STOP,)),
        session=SessionRef(session_id=session_id, parent_rid=parent),
    )


async def test_sim_engine_tags_tokens_with_the_version_that_made_them() -> None:
    model = EngineModel(prefill_s=0.0, per_token_s=0.001, length_median=100, length_sigma=0.0)
    engine = SimEngine(model)
    session = await engine.open_session()
    first = asyncio.create_task(engine.generate(_request(session)))
    await asyncio.sleep(0.02)
    assert await engine.update_weights(WeightUpdate(state_dict={})) == 1
    result = await first
    versions = result.token_versions()
    assert len(result.output_ids) == 100 and result.output_ids[-1] == STOP
    assert result.finish_reason == "stop" and len(result.logprobs) == 100
    assert versions == sorted(versions) and set(versions) <= {0, 1}

    second = await engine.generate(_request(session, parent=result.rid))
    assert set(second.token_versions()) == {1}
    assert second.cached_tokens == second.prompt_tokens - 3 == 103
    await engine.close()


async def test_sim_engine_aborts_with_the_tokens_so_far() -> None:
    engine = SimEngine(EngineModel(prefill_s=0.0, per_token_s=0.01, length_median=100))
    session = await engine.open_session()
    request = _request(session)
    running = asyncio.create_task(engine.generate(request))
    await asyncio.sleep(0.05)
    await engine.abort(request.rid)
    result = await running
    assert result.finish_reason == "abort" and STOP not in result.output_ids
    assert len(result.output_ids) < 100
    await engine.close()


async def test_a_pool_of_sim_engines_takes_an_empty_state_dict_update() -> None:
    pool = EnginePool([SimEngine(seed=i) for i in range(3)])
    await pool.pause()
    assert await pool.update_weights(WeightUpdate(state_dict={})) == 1
    await pool.resume()
    info = await pool.info()
    assert info.weight_version == 1 and info.extra["max_batch_size"] == 3 * 128
    assert [e.version for e in pool.engines() if isinstance(e, SimEngine)] == [1, 1, 1]
    await pool.close()
