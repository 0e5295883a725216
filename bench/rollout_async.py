"""How much does asynchronous rollout buy over a synchronous schedule
(docs/architecture.md, "Asynchrony and staleness")?

One workload, four schedules, in one run. The workload: multi-turn episodes of
`agentflow/latency-model-v0` (2-6 turns, long-tailed env waits) played by the white-box
agent on a `LatencyModelEngine` (long-tailed response lengths, a decode step that slows
with the batch, a batch cap), scheduled by the real `RunExecutor` (staleness gate, weight
updates through the run's runtime) and recorded in a scratch database. A simulated trainer
pulls `--batch` trajectories from the run's `DbTrajectoryStream`, "trains" for
`--train-s` seconds, publishes version + 1 through `RunExecutor.update_weights` and acks.

Schedules (the same workload each time):
- synchronous: `max_staleness = 0` (a barrier per batch), no partial rollout;
- one-step-off: `max_staleness = 1`, no partial rollout (updates drain running requests);
- fully async: `max_staleness = 2`, no partial rollout, no replay (`max_reuse = 1`);
- async + partial + replay: `max_staleness = 2`, partial rollout (updates retract running
  requests, which continue under the new weights), `max_reuse = 2`.

Each is warmed up for `--warmup` s, then measured for `--seconds` s. Printed per schedule,
each rate also as a ratio to synchronous: fresh trajectories produced per second, samples
trained per second, fresh (not replayed) samples trained per second; the engine's busy
fraction (time with at least one request decoding) and mean decode batch; the trainer's
idle fraction (time not training: waiting for data, or for its weights to go live); and
the staleness histogram of the samples it trained on. `--only async+partial` adds partial
rollout without replay, to tell the two apart; `async+partial(abort)` interrupts by
abort and resubmission instead of retract.

    python bench/rollout_async.py [--seconds 30] [--time-scale 0.25] [--db sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db import migrate
from agentflow.db.models import Run
from agentflow.db.models import Trajectory as TrajectoryRow
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import PauseMode, SamplingParams, WeightUpdate
from agentflow.rollout.envs import resolve_env_sources
from agentflow.rollout.executor import RunExecutor
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import (
    AgentConfig,
    EnvEntry,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from agentflow.tokenization.chat import ByteChatTemplate

# Run as a script, only bench/ is on sys.path: `bench` and `tests` import from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.latency_engine import LatencyModelConfig, LatencyModelEngine  # noqa: E402
from bench.latency_env import ENV_ID, register  # noqa: E402
from tests.support.scratch_db import scratch_database  # noqa: E402

SCHEDULES: dict[str, dict[str, Any]] = {
    "synchronous": {"max_staleness": 0, "partial_rollout": False, "max_reuse": 1},
    "one-step-off": {"max_staleness": 1, "partial_rollout": False, "max_reuse": 1},
    "fully async": {"max_staleness": 2, "partial_rollout": False, "max_reuse": 1},
    "async+partial+replay": {"max_staleness": 2, "partial_rollout": True, "max_reuse": 2},
}
# Not run by default (`--only`): partial rollout without replay, by retract or by abort.
EXTRA_SCHEDULES: dict[str, dict[str, Any]] = {
    "async+partial": {"max_staleness": 2, "partial_rollout": True, "max_reuse": 1},
    "async+partial(abort)": {
        "max_staleness": 2,
        "partial_rollout": True,
        "max_reuse": 1,
        "interrupt": "abort",
    },
}


@dataclass
class TrainStep:
    pulled_at: float  # the batch is complete; training starts
    trained_at: float  # training done; publishing starts
    published_at: float
    staleness: list[int]
    replays: int


@dataclass
class Measured:
    fresh_per_s: float
    trained_per_s: float
    engine: dict[str, Any]
    trainer_idle: float
    fresh_trained_per_s: float
    publish_s: float  # mean wall time of one weight update (drain or retract, switch)
    staleness: Counter[int]
    steps: int
    replays: int
    dropped_stale: int
    resubmitted: int
    statuses: dict[str, int] = field(default_factory=dict)


def engine_config(args: argparse.Namespace) -> LatencyModelConfig:
    # In model seconds (`time_scale` shrinks them): a decode step of 10 ms + 0.25 ms per
    # sequence, responses of median 48 tokens with a lognormal tail cut at 512, and a
    # weight switch that stalls decoding for 0.2 s.
    return LatencyModelConfig(
        seed=0,
        max_batch_size=args.max_batch,
        step_base_s=0.010,
        step_per_seq_s=0.00025,
        prefill_s_per_token=0.00002,
        update_s=0.2,
        time_scale=args.time_scale,
        length_median=48,
        length_sigma=1.0,
        length_max=512,
    )


def env_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    # 2-6 turns per task; each env step waits a median 1 s, with a lognormal tail to 15 s.
    return {
        "min_turns": 2,
        "max_turns": 6,
        "latency_median_s": 1.0,
        "latency_sigma": 1.0,
        "latency_max_s": 15.0,
        "time_scale": args.time_scale,
    }


async def trainer(
    stream: DbTrajectoryStream,
    executor: RunExecutor,
    batch: int,
    train_s: float,
    steps: list[TrainStep],
) -> None:
    """Pull a batch, train, publish version + 1, ack; until cancelled."""
    while True:
        pulled: list[Any] = []
        while len(pulled) < batch:
            want = batch - len(pulled)
            pulled += await stream.pull(want, timeout=1.0, min_n=want)
        started = time.perf_counter()
        version = executor.weight_version
        staleness = [t.staleness(version) or 0 for t in pulled]
        await asyncio.sleep(train_s)
        trained = time.perf_counter()
        await executor.update_weights(WeightUpdate(state_dict={}))
        published = time.perf_counter()
        leases: dict[str | None, list[uuid.UUID]] = {}
        for t in pulled:
            leases.setdefault(t.lease_id, []).append(t.id)
        for lease_id, ids in leases.items():
            await stream.ack(ids, lease_id=lease_id)
        replays = sum(t.times_served > 0 for t in pulled)
        steps.append(TrainStep(started, trained, published, staleness, replays))


async def count_trajectories(turns: TurnTree, run_id: uuid.UUID) -> int:
    async with turns.sessions() as session:
        count = await session.scalar(
            select(func.count()).select_from(TrajectoryRow).where(TrajectoryRow.run_id == run_id)
        )
    return int(count or 0)


async def measure(args: argparse.Namespace, url: str, name: str) -> Measured:
    db = create_engine(url)
    sessions = session_factory(db)
    turns = TurnTree(sessions)
    config = RunConfig(
        name="bench-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-"),
        seed=0,
        envs=[EnvEntry(id=ENV_ID, kwargs=env_kwargs(args), max_concurrency=1024)],
        agent=AgentConfig(max_turns=8, max_tokens=8192, max_new_tokens=512),
        rollout=RolloutConfig(
            group_size=args.group, max_concurrency=1024, **{**SCHEDULES, **EXTRA_SCHEDULES}[name]
        ),
        trainer=TrainerConfig(batch_episodes=args.batch),
    )
    run_id = uuid.uuid4()
    async with sessions.begin() as session:
        config_json = config.model_dump(mode="json")
        session.add(Run(id=run_id, name=config.name, config=config_json, status="running"))
    engine = LatencyModelEngine(engine_config(args))
    template = ByteChatTemplate()
    rollout = config.rollout
    runtime = PolicyRuntime(
        engine,
        template,
        config.name,
        SamplingParams(
            max_new_tokens=config.agent.max_new_tokens, stop_token_ids=template.stop_ids
        ),
        max_context=8192,
        partial_rollout=rollout.partial_rollout,
        interrupt=PauseMode(rollout.interrupt),
    )
    executor = RunExecutor(
        run_id,
        config,
        turns=turns,
        runtime=runtime,
        sources=await resolve_env_sources(sessions, config.envs),
        agent=WhiteBoxAgent(park_after_s=rollout.park_after_s),
        gateway_url="http://127.0.0.1:1",
        secret_key="bench-only-secret",
    )
    stream = executor.trajectory_stream()
    steps: list[TrainStep] = []
    await executor.start()
    training = asyncio.create_task(trainer(stream, executor, args.batch, args.train_s, steps))
    await asyncio.sleep(args.warmup)

    engine.reset_stats()
    before = await count_trajectories(turns, run_id)
    dropped_before = stream.counters.dropped_stale
    resubmitted_before = runtime.resubmitted
    start = time.perf_counter()
    await asyncio.sleep(args.seconds)
    end = time.perf_counter()
    info = await engine.info()
    after = await count_trajectories(turns, run_id)

    training.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await training
    await executor.stop("benchmark over")
    await engine.close()
    await db.dispose()

    window = end - start
    inside = [s for s in steps if start <= s.trained_at <= end]
    train_s = sum(max(0.0, min(s.trained_at, end) - max(s.pulled_at, start)) for s in steps)
    staleness: Counter[int] = Counter()
    for s in inside:
        staleness.update(s.staleness)
    return Measured(
        fresh_per_s=(after - before) / window,
        trained_per_s=sum(len(s.staleness) for s in inside) / window,
        engine=info.extra,
        fresh_trained_per_s=sum(len(s.staleness) - s.replays for s in inside) / window,
        trainer_idle=1.0 - train_s / window,
        publish_s=sum(s.published_at - s.trained_at for s in inside) / max(1, len(inside)),
        staleness=staleness,
        steps=len(inside),
        replays=sum(s.replays for s in inside),
        dropped_stale=stream.counters.dropped_stale - dropped_before,
        resubmitted=runtime.resubmitted - resubmitted_before,
        statuses=dict(executor.counters.by_status),
    )


@contextlib.contextmanager
def database(kind: str) -> Iterator[str]:
    if kind == "postgresql":
        with scratch_database(prefix="agentflow_bench") as url:
            yield url
        return
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        migrate.upgrade(url)
        yield url


def histogram(counts: Counter[int]) -> str:
    total = sum(counts.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counts.items())) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured, per schedule")
    parser.add_argument("--warmup", type=float, default=6.0, help="before measuring")
    parser.add_argument("--time-scale", type=float, default=0.25, help="engine and env times")
    parser.add_argument("--batch", type=int, default=32, help="trainer batch (episodes)")
    parser.add_argument("--group", type=int, default=4, help="samples per task")
    parser.add_argument("--train-s", type=float, default=1.5, help="simulated train step")
    parser.add_argument("--max-batch", type=int, default=64, help="engine batch cap")
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--only", nargs="*", choices=[*SCHEDULES, *EXTRA_SCHEDULES], help="a subset"
    )
    args = parser.parse_args()
    register()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; db {args.db}")
    results: dict[str, Measured] = {}
    for name in args.only or list(SCHEDULES):
        with database(args.db) as url:
            results[name] = asyncio.run(measure(args, url, name))
        r = results[name]
        print(f"  {name}: {r.steps} train steps, episodes {r.statuses}", flush=True)
    base = results.get("synchronous")
    print(
        f"\nbatch {args.batch} episodes (groups of {args.group}), train step {args.train_s}s, "
        f"time scale {args.time_scale}, measured {args.seconds}s after {args.warmup}s"
    )

    def ratio(value: float, of: float | None) -> str:
        return f"{value / of:.2f}x" if of else "-"

    print(
        f"{'schedule':<22}{'fresh/s':>14}{'trained/s':>16}{'fresh trained/s':>18}"
        f"{'engine busy':>13}{'mean batch':>12}{'trainer idle':>14}  staleness of trained"
    )
    for name, r in results.items():
        fresh = f"{r.fresh_per_s:.2f} {ratio(r.fresh_per_s, base.fresh_per_s if base else None)}"
        trained = (
            f"{r.trained_per_s:.2f} {ratio(r.trained_per_s, base.trained_per_s if base else None)}"
        )
        useful = f"{r.fresh_trained_per_s:.2f} " + ratio(
            r.fresh_trained_per_s, base.fresh_trained_per_s if base else None
        )
        print(
            f"{name:<22}{fresh:>14}{trained:>16}{useful:>18}"
            f"{r.engine['busy_fraction']:>13.1%}{r.engine['mean_batch']:>12.1f}"
            f"{r.trainer_idle:>14.1%}  {histogram(r.staleness)}"
        )
    print(
        "\nper schedule: replayed samples trained, trajectories dropped as stale, "
        "continuations after an abort, mean time to publish a version, tokens decoded"
    )
    for name, r in results.items():
        print(
            f"  {name:<22} replays {r.replays:<5} dropped {r.dropped_stale:<5} "
            f"resubmitted {r.resubmitted:<5} publish {r.publish_s:.2f}s  "
            f"tokens {r.engine['tokens_decoded']}"
        )


if __name__ == "__main__":
    main()
