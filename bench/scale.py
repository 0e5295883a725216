"""How does one controller behave as its concurrent episodes grow to 10,000?

The controller is the project's own code, in one process on one event loop, as the
gateway runs it: the scheduler (`RunExecutor`: staleness gate, pool, admission), the
white-box agent and its episode loop, the policy runtime over an `EnginePool` of
`--engines` engines, turns recorded by `TurnTree` (group commit), and the run's durable
`DbTrajectoryStream` with leases, on a fresh scratch database. Simulated around it
(`bench/scale_sim.py`): the engines (a timer per request: prefill plus a per-token
decode time, bounded batch slots), the env (`bench/scale-sim-v0`: 2-6 turns, lognormal
step latencies around 50 ms, a 0/1 reward at the end) and the trainer, a task that
leases `batch` trajectories from the stream, "trains" for `--train-s` seconds, publishes
a new version through `RunExecutor.update_weights` (a partial-rollout switch of every
engine) and acknowledges.

For each level (`rollout.max_concurrency` = the level): warm up, then measure a fixed
window. Per level:
- CPU: the process's CPU seconds in the window (`time.process_time`) per agent turn (one
  generation and the env step that answers it), and over wall seconds: the cores the
  controller used. One event loop can use one core; near 1.0 it is saturated;
- turns/s, and `ideal/s`: what the live episodes would make if the controller cost no
  time (live episodes / (modeled generation + env seconds per turn)); `achieved` is
  turns/s over ideal/s;
- database writes per second: turn rows (prompt, policy and env turns), episodes
  finished, trajectories created (rows stamped inside the window);
- the trainer: trajectories consumed per second, weight versions published, and the
  staleness of what it consumed (its version at consumption minus the trajectory's
  oldest token version): p50/p90/max and the histogram;
- why: the event loop's lag (how late a 50 ms sleep wakes), the cyclic garbage
  collector's share of the CPU and its full collections, SQL statements sent through
  SQLAlchemy per turn (and by kind, with their wall time; on PostgreSQL the group
  commits of turns and episodes go straight to asyncpg and are not among them), turns
  queued for the group commit, database connections checked out, episode
  wall time, the CPU of the whole machine and of PostgreSQL's processes, and the warnings
  and errors the project logged (an episode's end that had to be written again, say).
Then ratios between consecutive levels, and whether the controller stayed under one core.

The trainer batch is half the level, at most 1,024 episodes (`--batch-fraction`,
`--max-batch`): the trainer must keep up with the episodes (a batch must take longer to
fill than a step takes), and at 10,000 it must still step inside the window.
`max_staleness` is `ceil(2.5 * level / batch)`: the staleness gate admits
`(max_staleness + 1)` batches ahead of the trainer, so the pool, not the gate, bounds the
live episodes, and the staleness the workload makes by itself stays inside the bound
(about live / batch versions, as the version moves once per batch, and a little more, as
a group waits for its slowest episode). The first wave of episodes all start together at
version 0, so the warm-up lasts at least `--warmup` s and until as many episodes as the
level have ended and the trainer has published, at most `--max-warmup` s.

`--profile` runs one more, shorter level under cProfile (CPU time, the measured window
only) and prints the top functions and own time by package. `--gc-threshold` sets the
cyclic garbage collector's thresholds, to see what it costs.

`--controllers 1,2` then plays each level again with that many controller shards
(`rollout.controllers`), processes that share the run, and prints their own table (see
"controller shards" below).

    python bench/scale.py [--levels 100,1000,10000] [--seconds 30] [--warmup 15]
                          [--database-url URL] [--profile [--profile-level 10000]]
                          [--controllers 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import io
import logging
import math
import os
import pstats
import random
import re
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.config import Settings
from agentflow.db import migrate
from agentflow.db.group_commit import WaitHistogram
from agentflow.db.runs import RunStore
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_sql import episodes as episodes_table
from agentflow.db.turn_sql import trajectories as trajectories_table
from agentflow.db.turn_sql import turns as turns_table
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import WeightUpdate
from agentflow.inference.pool import EnginePool
from agentflow.rollout.envs import resolve_env_sources
from agentflow.rollout.executor import RunExecutor
from agentflow.rollout.runtime_setup import policy_runtime
from agentflow.rollout.shards.coordinator import ShardedRun
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import (
    AgentConfig,
    EnvEntry,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    WeightsConfig,
)
from agentflow.tokenization.bytes import ByteTokenizer
from agentflow.tokenization.chat import chat_template_for

# Run as a script, only bench/ is on sys.path: `bench` and `tests` import from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.scale_sim import (  # noqa: E402
    ENV_ID,
    ENV_STATS,
    EngineModel,
    EngineStats,
    SimEngine,
    register_env,
)
from tests.support.scratch_db import scratch_database  # noqa: E402

LAG_PERIOD_S = 0.05


@dataclass(frozen=True)
class Workload:
    """Everything but the level: the simulated latencies and the run's settings."""

    engines: int = 100
    engine: EngineModel = field(default_factory=EngineModel)
    min_turns: int = 2
    max_turns: int = 6
    env_latency_s: float = 0.05  # median of the lognormal step latency
    env_sigma: float = 0.5
    env_latency_max_s: float = 2.0
    group_size: int = 8
    batch_fraction: float = 0.5  # trainer batch, as a fraction of the level (in episodes)
    max_batch: int = 1024  # ... and at most this many episodes
    max_staleness: int | None = None  # None: see `staleness`
    train_s: float = 0.5
    max_new_tokens: int = 256

    def batch(self, level: int) -> int:
        return min(self.max_batch, max(self.group_size, round(level * self.batch_fraction)))

    def staleness(self, level: int) -> int:
        """`max_staleness` for `level`: the gate admits `(max_staleness + 1)` batches
        ahead of the trainer, so the pool, not the gate, bounds the live episodes; and the
        staleness the workload makes by itself (about live / batch, more for a group's
        slowest episode) stays inside the bound."""
        if self.max_staleness is not None:
            return self.max_staleness
        return math.ceil(2.5 * level / self.batch(level))

    def config(self, level: int) -> RunConfig:
        env_kwargs = {
            "min_turns": self.min_turns,
            "max_turns": self.max_turns,
            "latency_median_s": self.env_latency_s,
            "latency_sigma": self.env_sigma,
            "latency_max_s": self.env_latency_max_s,
        }
        return RunConfig(
            name=f"scale-{level}",
            seed=0,
            envs=[EnvEntry(id=ENV_ID, kwargs=env_kwargs, max_concurrency=level)],
            agent=AgentConfig(
                max_turns=self.max_turns + 2, max_tokens=8192, max_new_tokens=self.max_new_tokens
            ),
            rollout=RolloutConfig(
                group_size=self.group_size,
                max_concurrency=level,
                max_staleness=self.staleness(level),
            ),
            trainer=TrainerConfig(batch_episodes=self.batch(level)),
        )


class _Window:
    """Rates over a measured window: turns played, the CPU seconds they cost."""

    played: int
    window_s: float
    cpu_s: float

    @property
    def turns_per_s(self) -> float:
        return self.played / self.window_s

    @property
    def cpu_ms_per_turn(self) -> float:
        return 1000 * self.cpu_s / max(1, self.played)

    @property
    def cores(self) -> float:
        return self.cpu_s / self.window_s


@dataclass
class LevelResult(_Window):
    level: int
    engines: int
    window_s: float
    cpu_s: float
    live_mean: float
    played: int  # agent turns played in the window: env steps answered
    rows: dict[str, int]  # turn rows written in the window, by kind
    episodes_finished: int
    trajectories_created: int
    episode_s: list[float]  # wall time of the episodes that finished in the window
    consumed: int  # trajectories the trainer leased in the window
    versions: int  # weight versions published in the window
    staleness: Counter[int]
    lag_s: list[float]
    queued_turns: list[int]  # turns waiting for the group commit, sampled
    connections: list[int]  # database connections checked out, sampled
    ideal_turn_s: float  # modeled generation + env step, per turn
    gc_s: float  # CPU seconds in the cyclic garbage collector
    gc_full: int  # its full (oldest generation) collections
    machine_cores: float | None
    db_cores: float | None
    statuses: dict[str, int]
    dropped_stale: int
    resubmitted: int
    warmup_s: float = 0.0
    teardown_s: float = 0.0
    logged: dict[str, int] = field(default_factory=dict)  # warnings and errors, by message
    statements: Counter[str] = field(default_factory=Counter)  # SQL sent in the window
    statement_s: Counter[str] = field(default_factory=Counter)  # ... their wall seconds
    # How long writes waited for their group commit in the window, by kind (histograms).
    write_waits: dict[str, list[int]] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        return sum(self.rows.values()) / self.window_s

    @property
    def ideal_per_s(self) -> float:
        return self.live_mean / self.ideal_turn_s if self.ideal_turn_s else 0.0

    @property
    def achieved(self) -> float:
        return self.turns_per_s / self.ideal_per_s if self.ideal_per_s else 0.0


@dataclass
class _Trained:
    at: float
    staleness: list[int]


# ---- the simulated trainer and the probes ----------------------------------------------


async def trainer(
    stream: DbTrajectoryStream,
    executor: RunExecutor | ShardedRun,
    batch: int,
    train_s: float,
    log: list[_Trained],
    published: list[float],
    *,
    update: WeightUpdate | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Lease a batch, train (sleep), publish the next version (`update`: in process by
    default; controller shards load from a directory), acknowledge; until `stop` is set
    (checked between database calls: a call cancelled halfway can leave an aiosqlite
    connection waiting for an answer that never comes) or until cancelled."""
    update = update or WeightUpdate(state_dict={})
    stop = stop or asyncio.Event()
    while not stop.is_set():
        pulled: list[Any] = []
        while len(pulled) < batch:
            if stop.is_set():
                return  # what it leased goes back when its lease expires
            want = batch - len(pulled)
            pulled += await stream.pull(want, timeout=1.0, min_n=want)
        version = executor.weight_version
        stale = [s for t in pulled if (s := t.staleness(version)) is not None]
        log.append(_Trained(time.perf_counter(), stale))
        await asyncio.sleep(train_s)
        await executor.update_weights(update)
        published.append(time.perf_counter())
        leases: dict[str | None, list[uuid.UUID]] = {}
        for t in pulled:
            leases.setdefault(t.lease_id, []).append(t.id)
        for lease_id, ids in leases.items():
            await stream.ack(ids, lease_id=lease_id)


async def _end_training(training: asyncio.Task[None], stop: asyncio.Event) -> None:
    """Ask the simulated trainer to stop between database calls; cancel it only if it
    has not within 30 s (a pull waits at most 1 s, a step `train_s`)."""
    stop.set()
    done, _ = await asyncio.wait({training}, timeout=30.0)
    if not done:
        training.cancel()
    await asyncio.gather(training, return_exceptions=True)


def live_episodes(executor: RunExecutor) -> int:
    counters = executor.counters
    return counters.started - sum(counters.by_status.values())


@dataclass
class _Sample:
    at: float
    lag_s: float
    live: int
    queued_turns: int
    connections: int


async def watch_loop(
    executor: RunExecutor, turns: TurnTree, db: AsyncEngine, samples: list[_Sample]
) -> None:
    """How late a short sleep wakes (the event loop's backlog), the live episodes, the
    turns queued for the group commit and the database connections in use."""
    loop = asyncio.get_running_loop()
    pool = db.sync_engine.pool
    while True:
        asked = loop.time()
        await asyncio.sleep(LAG_PERIOD_S)
        lag = loop.time() - asked - LAG_PERIOD_S
        queued = turns.queued_writes["turns"]
        checked_out = getattr(pool, "checkedout", lambda: 0)()
        samples.append(
            _Sample(
                time.perf_counter(), max(0.0, lag), live_episodes(executor), queued, checked_out
            )
        )


class GcMeter:
    """CPU seconds spent in the cyclic garbage collector, and its full collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
            return
        self.seconds += time.process_time() - self._started
        self.full += info["generation"] == 2


_TABLE = re.compile(r"\b(?:INTO|FROM)\s+(\w+)", re.IGNORECASE)


def statement_kind(statement: str) -> str:
    """`INSERT turns`, `UPDATE episodes`, `SELECT trajectories`: verb and first table."""
    words = statement.split(None, 2)
    if not words:
        return "?"
    verb = words[0].upper()
    if verb == "UPDATE" and len(words) > 1:
        return f"UPDATE {words[1]}"
    found = _TABLE.search(statement)
    return f"{verb} {found.group(1)}" if found else verb


class StatementTally:
    """SQL statements sent, by verb and first table (`INSERT turns`); an executemany counts
    once. BEGIN and COMMIT are not statements here (the driver sends them itself)."""

    def __init__(self, db: AsyncEngine) -> None:
        self.db = db
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # wall time from send to answer, by kind

    def __enter__(self) -> StatementTally:
        event.listen(self.db.sync_engine, "before_cursor_execute", self._seen)
        event.listen(self.db.sync_engine, "after_cursor_execute", self._answered)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.db.sync_engine, "before_cursor_execute", self._seen)
        event.remove(self.db.sync_engine, "after_cursor_execute", self._answered)

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.counts[statement_kind(statement)] += 1
        conn.info["bench_sent"] = time.perf_counter()

    def _answered(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent = conn.info.pop("bench_sent", None)
        if sent is not None:
            self.seconds[statement_kind(statement)] += time.perf_counter() - sent


class LogTally(logging.Handler):
    """Counts the project's warnings and errors by level and message: what a run logs and
    goes on from, such as an episode's end that had to be written again."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname}: {record.msg}"] += 1


class FirstOfEach(logging.Filter):
    """Lets the first record of each message through; a flood says nothing new."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> dict[int, float] | None:
    """CPU seconds of each process named postgres (Linux), or None."""
    found: dict[int, float] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.partition(") ")
        if name.endswith("(postgres"):
            fields = rest.split()
            found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return found or None


def _delta(before: float | None, after: float | None, wall: float) -> float | None:
    return None if before is None or after is None else (after - before) / wall


def _postgres_delta(
    before: dict[int, float] | None, after: dict[int, float] | None, wall: float
) -> float | None:
    """Cores used by postgres processes; one that started in the window counts whole."""
    if before is None or after is None:
        return None
    return sum(t - before.get(pid, 0.0) for pid, t in after.items()) / wall


def _engine_totals(engines: Sequence[SimEngine]) -> EngineStats:
    total = EngineStats()
    for engine in engines:
        for f in dataclasses.fields(EngineStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(engine.stats, f.name))
    return total


async def _written(
    turns: TurnTree, run_id: uuid.UUID, start: datetime, end: datetime
) -> tuple[dict[str, int], int, int, list[float]]:
    """Rows the run wrote in [start, end): turns by kind, episodes finished, trajectories
    created; and the wall time of the episodes that finished."""
    t, e, tr = turns_table, episodes_table, trajectories_table
    async with turns.sessions() as session:
        by_kind = await session.execute(
            select(t.c.kind, func.count())
            .select_from(t.join(e, e.c.id == t.c.episode_id))
            .where(e.c.run_id == run_id, t.c.created_at >= start, t.c.created_at < end)
            .group_by(t.c.kind)
        )
        rows = {str(kind): int(n) for kind, n in by_kind}
        finished = (
            await session.execute(
                select(e.c.created_at, e.c.finished_at).where(
                    e.c.run_id == run_id, e.c.finished_at >= start, e.c.finished_at < end
                )
            )
        ).all()
        created = await session.scalar(
            select(func.count())
            .select_from(tr)
            .where(tr.c.run_id == run_id, tr.c.created_at >= start, tr.c.created_at < end)
        )
    spans = [(b - a).total_seconds() for a, b in finished]
    return rows, len(finished), int(created or 0), spans


# ---- one level ------------------------------------------------------------------------------


@dataclass
class Controller:
    """The controller of one level, built as `RunManager` builds a run's."""

    db: AsyncEngine
    turns: TurnTree
    config: RunConfig
    executor: RunExecutor
    pool: EnginePool
    engines: list[SimEngine]
    runtime: PolicyRuntime


async def build_controller(level: int, workload: Workload, url: str) -> Controller:
    db = create_engine(url)
    sessions = session_factory(db)
    turns = TurnTree(sessions)
    runs = RunStore(sessions)
    config = workload.config(level)
    sources = await resolve_env_sources(sessions, config.envs)
    run_id = await runs.create(
        config.name,
        config.model_dump(mode="json"),
        (s.environment_id for s in sources if s.environment_id is not None),
    )
    engines = [SimEngine(workload.engine, seed=i) for i in range(workload.engines)]
    pool = EnginePool(engines)
    # As `RunManager` builds a run's runtime and white-box agent.
    template = chat_template_for(ByteTokenizer())
    runtime = policy_runtime(config, pool, template, workload.engine.max_context)
    agent = WhiteBoxAgent(
        park_after_s=config.rollout.park_after_s,
        system_prompt=config.agent.system_prompt,
        branch_turns=config.rtpo.branch_turns,
        rng=random.Random(config.seed),
    )
    executor = RunExecutor(
        run_id,
        config,
        turns=turns,
        runs=runs,
        runtime=runtime,
        sources=sources,
        agent=agent,
        gateway_url="",
        secret_key="bench-scale-secret",
    )
    return Controller(db, turns, config, executor, pool, engines, runtime)


async def run_level(
    level: int,
    workload: Workload,
    url: str,
    *,
    warmup_s: float,
    seconds: float,
    max_warmup_s: float = 150.0,
    profile: cProfile.Profile | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> LevelResult:
    """Run the controller at `level` concurrent episodes; measure `seconds` after a
    warm-up of `warmup_s` to `max_warmup_s` (see the module docstring)."""
    c = await build_controller(level, workload, url)
    db, turns, executor, pool, engines, runtime = (
        c.db,
        c.turns,
        c.executor,
        c.pool,
        c.engines,
        c.runtime,
    )
    config = c.config
    stream = executor.trajectory_stream()
    trained: list[_Trained] = []
    published: list[float] = []
    samples: list[_Sample] = []
    tally = LogTally()
    logging.getLogger("agentflow").addHandler(tally)
    await executor.start()
    batch = config.trainer.batch_episodes
    stop_training = asyncio.Event()
    training = asyncio.create_task(
        trainer(stream, executor, batch, workload.train_s, trained, published, stop=stop_training)
    )
    tasks = [training, asyncio.create_task(watch_loop(executor, turns, db, samples))]
    try:
        # The first wave of episodes all start at once, at version 0: measure once as many
        # episodes as the level have ended (each slot has turned over) and the trainer has
        # published, or after `max_warmup_s`.
        began = time.perf_counter()
        await asyncio.sleep(warmup_s)
        while time.perf_counter() - began < max_warmup_s and (
            not published or sum(executor.counters.by_status.values()) < level
        ):
            await asyncio.sleep(0.5)
        warmed = time.perf_counter() - began
        progress(f"level {level}: {live_episodes(executor)} live after {warmed:.0f} s warm-up")
        engine_before = _engine_totals(engines)
        env_before = dataclasses.replace(ENV_STATS)
        statuses_before = dict(executor.counters.by_status)
        dropped_before = stream.counters.dropped_stale
        resubmitted_before = runtime.resubmitted
        start_at = datetime.now(UTC)
        waits0 = turns.write_waits
        machine0, db0 = machine_busy_s(), postgres_cpu_s()
        with GcMeter() as collector, StatementTally(db) as sql:
            start, cpu0 = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            await asyncio.sleep(seconds)
            if profile is not None:
                profile.disable()
            end, cpu1 = time.perf_counter(), time.process_time()
        machine1, db1 = machine_busy_s(), postgres_cpu_s()
        waits1 = turns.write_waits
        end_at = datetime.now(UTC)
        engine_after = _engine_totals(engines)
        env_after = dataclasses.replace(ENV_STATS)
        statuses = {
            k: v - statuses_before.get(k, 0) for k, v in executor.counters.by_status.items()
        }
        dropped = stream.counters.dropped_stale - dropped_before
        resubmitted = runtime.resubmitted - resubmitted_before
    finally:
        await _end_training(training, stop_training)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stopping = time.perf_counter()
        await executor.stop("benchmark over")
        teardown_s = time.perf_counter() - stopping
        await pool.close()
        logging.getLogger("agentflow").removeHandler(tally)
    rows, finished, created, episode_s = await _written(turns, executor.run_id, start_at, end_at)
    await db.dispose()

    wall = end - start
    requests = engine_after.requests - engine_before.requests
    steps = env_after.steps - env_before.steps
    gen_s = (engine_after.modeled_s - engine_before.modeled_s) / max(1, requests)
    env_s = (env_after.slept_s - env_before.slept_s) / max(1, steps)
    window = [s for s in samples if start <= s.at <= end]
    inside = [t for t in trained if start <= t.at <= end]
    staleness: Counter[int] = Counter()
    for step in inside:
        staleness.update(step.staleness)
    return LevelResult(
        level=level,
        engines=workload.engines,
        window_s=wall,
        cpu_s=cpu1 - cpu0,
        live_mean=sum(s.live for s in window) / max(1, len(window)),
        played=steps,
        rows=rows,
        episodes_finished=finished,
        trajectories_created=created,
        episode_s=episode_s,
        consumed=sum(len(t.staleness) for t in inside),
        versions=sum(start <= p <= end for p in published),
        staleness=staleness,
        lag_s=[s.lag_s for s in window],
        queued_turns=[s.queued_turns for s in window],
        write_waits=wait_delta(waits0, waits1),
        connections=[s.connections for s in window],
        ideal_turn_s=gen_s + env_s,
        gc_s=collector.seconds,
        gc_full=collector.full,
        machine_cores=_delta(machine0, machine1, wall),
        db_cores=_postgres_delta(db0, db1, wall),
        statuses=statuses,
        dropped_stale=dropped,
        resubmitted=resubmitted,
        warmup_s=warmed,
        teardown_s=teardown_s,
        logged=dict(tally.counts),
        statements=sql.counts,
        statement_s=sql.seconds,
    )


# ---- controller shards ----------------------------------------------------------------------
# `--controllers N,...`: the same workload played by N controller shards
# (`rollout.controllers = N`, `agentflow.rollout.shards`), each a process with its share
# of the live episodes and of the simulated engines (`bench/scale_shard.py`); the
# coordinator and the simulated trainer in this process. Measured the same way for every
# N: turns played (env turn rows written in the window, from the database), the CPU of
# every controller process (this one's and each shard's, from /proc) per turn, the cores
# they used, PostgreSQL's, episode wall times, the staleness of what the trainer
# consumed, and the shards' group commits (`ShardedRun.shard_writes`: turns queued,
# summed over the shards, and how long turns and episode ends waited for their writes).
# (The in-process controller above counts turns at the simulated env; the two counts
# agree to within the turns in flight at the window's edges.) The shards' own warnings
# go to their stderr, not to the tally.


ROOT = Path(__file__).resolve().parent.parent  # the shards import bench.scale_shard


@dataclass
class ShardedResult(_Window):
    level: int
    controllers: int
    window_s: float
    played: int  # env turns written in the window
    cpu_s: float  # every controller process: the coordinator's and each shard's
    shard_cpu_s: float  # ... of which the shards'
    db_cores: float | None
    episode_s: list[float]
    consumed: int
    staleness: Counter[int]
    max_staleness: int
    logged: dict[str, int]
    replaced: int
    queued_turns: list[int]  # the shards' turns queued for their group commits, summed
    write_waits: dict[str, list[int]]  # the window's wait histograms, summed over shards


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far (Linux)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(") ")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sharded_config(workload: Workload, level: int, controllers: int) -> RunConfig:
    config = workload.config(level)
    rollout = config.rollout.model_copy(update={"controllers": controllers})
    document = config.model_dump(mode="json")
    document["rollout"] = rollout.model_dump(mode="json")
    document["weights"] = WeightsConfig(sync="disk").model_dump(mode="json")
    return RunConfig.model_validate(document)  # the shard rules checked as for any run


async def run_sharded_level(
    level: int,
    controllers: int,
    workload: Workload,
    url: str,
    *,
    warmup_s: float,
    seconds: float,
    max_warmup_s: float = 150.0,
    progress: Callable[[str], None] = lambda line: None,
) -> ShardedResult:
    """`level` live episodes over `controllers` shard processes; see the module docstring."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # the shards import bench.scale_shard
    db = create_engine(url)
    sessions = session_factory(db)
    turns = TurnTree(sessions)
    runs = RunStore(sessions)
    config = sharded_config(workload, level, controllers)
    sources = await resolve_env_sources(sessions, config.envs)
    run_id = await runs.create(config.name, config.model_dump(mode="json"), ())
    run = ShardedRun(
        run_id,
        config,
        turns=turns,
        runs=runs,
        sources=sources,
        settings=Settings(database_url=url, secret_key="bench-scale-secret"),
        worker_options={
            "preload": ["bench.scale_shard"],
            "runtime_factory": "bench.scale_shard:runtime",
            "runtime_options": {
                "engines": workload.engines,
                "engine": dataclasses.asdict(workload.engine),
            },
        },
    )
    stream = run.trajectory_stream()
    trained: list[_Trained] = []
    published: list[float] = []
    tally = LogTally()
    logging.getLogger("agentflow").addHandler(tally)
    weights = Path(tempfile.mkdtemp(prefix="scale-shards-"))  # simulated engines read nothing
    await run.start()
    batch = config.trainer.batch_episodes
    update = WeightUpdate(path=str(weights))
    stop_training = asyncio.Event()
    training = asyncio.create_task(
        trainer(
            stream,
            run,
            batch,
            workload.train_s,
            trained,
            published,
            update=update,
            stop=stop_training,
        )
    )
    try:
        began = time.perf_counter()
        await asyncio.sleep(warmup_s)
        while time.perf_counter() - began < max_warmup_s and (
            not published or sum(run.counters.by_status.values()) < level
        ):
            await asyncio.sleep(0.5)
        progress(
            f"level {level}, {controllers} shards: warmed up after "
            f"{time.perf_counter() - began:.0f} s"
        )
        pids = run.shard_pids()
        start_at = datetime.now(UTC)
        db0 = postgres_cpu_s()
        writes0 = await run.shard_writes()
        start, own0 = time.perf_counter(), time.process_time()
        shards0 = {pid: process_cpu_s(pid) for pid in pids}
        queued: list[int] = []
        while time.perf_counter() - start < seconds:
            await asyncio.sleep(LAG_PERIOD_S)
            now = await run.shard_writes()
            queued.append(sum(int(w["queued"]["turns"]) for w in now.values()))
        end, own1 = time.perf_counter(), time.process_time()
        shards1 = {pid: process_cpu_s(pid) for pid in pids if pid in run.shard_pids()}
        db1 = postgres_cpu_s()
        writes1 = await run.shard_writes()
        end_at = datetime.now(UTC)
    finally:
        await _end_training(training, stop_training)
        await run.stop("benchmark over")
        logging.getLogger("agentflow").removeHandler(tally)
    rows, _, _, episode_s = await _written(turns, run_id, start_at, end_at)
    await db.dispose()
    wall = end - start
    shard_cpu = sum(shards1[pid] - shards0[pid] for pid in shards1)
    staleness: Counter[int] = Counter()
    inside = [t for t in trained if start <= t.at <= end]
    for step in inside:
        staleness.update(step.staleness)
    return ShardedResult(
        level=level,
        controllers=controllers,
        window_s=wall,
        played=rows.get("env", 0),
        cpu_s=(own1 - own0) + shard_cpu,
        shard_cpu_s=shard_cpu,
        db_cores=_postgres_delta(db0, db1, wall),
        episode_s=episode_s,
        consumed=sum(len(t.staleness) for t in inside),
        staleness=staleness,
        max_staleness=config.rollout.max_staleness,
        logged=dict(tally.counts),
        replaced=run.replacements,
        queued_turns=queued,
        write_waits=_window_waits(writes0, writes1),
    )


def wait_delta(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, list[int]]:
    """Write-wait histograms (`TurnTree.write_waits`) over a window: after minus before."""
    return {k: [b - a for a, b in zip(before[k], after[k], strict=True)] for k in after}


def _window_waits(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]
) -> dict[str, list[int]]:
    """The shards' write-wait histograms over the window, summed (a shard replaced
    meanwhile is left out: its counts restarted)."""
    summed: dict[str, list[int]] = {}
    for pid, end in after.items():
        if pid not in before:
            continue
        for kind, delta in wait_delta(before[pid]["waits"], end["waits"]).items():
            total = summed.setdefault(kind, [0] * len(delta))
            summed[kind] = [t + d for t, d in zip(total, delta, strict=True)]
    return summed


def sharded_report(results: Sequence[ShardedResult]) -> list[str]:
    lines = [
        "| episodes | shards | turns/s | ms CPU/turn (all controller processes) | cores "
        "(shards) | PostgreSQL cores | episode p50 | consumed/s | staleness (bound) "
        "| turns queued to commit p50/max | a turn's write waits p50/p99 ms "
        "| an episode's end waits p50/p99 ms | shards replaced | logged |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        db = "-" if r.db_cores is None else f"{r.db_cores:.2f}"
        logged = ", ".join(f"{n}x {m[:60]}" for m, n in r.logged.items()) or "nothing"
        lines.append(
            f"| {r.level:,} | {r.controllers} | {r.turns_per_s:,.0f} | {r.cpu_ms_per_turn:.2f} "
            f"| {r.cores:.2f} ({r.shard_cpu_s / r.window_s:.2f}) | {db} "
            f"| {quantile(r.episode_s, 0.5):.1f} s | {r.consumed / r.window_s:,.0f} "
            f"| {staleness_summary(r.staleness)} ({r.max_staleness}) "
            f"| {quantile(r.queued_turns, 0.5):,.0f}/{max(r.queued_turns, default=0):,} "
            f"| {_waits(r.write_waits.get('turns'))} "
            f"| {_waits(r.write_waits.get('episode_ends'))} | {r.replaced} | {logged} |"
        )
    by_level: dict[int, dict[int, ShardedResult]] = {}
    for r in results:
        by_level.setdefault(r.level, {})[r.controllers] = r
    for level, by_count in by_level.items():
        one = by_count.get(1)
        for count, r in sorted(by_count.items()):
            if one is not None and count != 1:
                lines.append(
                    f"\n{level:,} episodes, {count} shards against 1: CPU per turn "
                    f"x{r.cpu_ms_per_turn / one.cpu_ms_per_turn:.2f}, turns/s "
                    f"x{r.turns_per_s / max(1e-9, one.turns_per_s):.2f}"
                )
    return lines


# ---- memory per live episode ----------------------------------------------------------------


@dataclass
class HeldMemory:
    level: int
    waiting: str  # "env" (sessions parked) or "engine" (requests in the engine)
    live: int
    parked: int  # sessions parked, of the live episodes
    python_bytes: int  # Python heap held by the live episodes (tracemalloc)
    rss_bytes: int  # the process's resident memory grew by this much meanwhile


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def held_memory(
    level: int, workload: Workload, url: str, *, waiting: str, settle_s: float = 60.0
) -> HeldMemory:
    """What `level` live episodes hold while every one of them waits: on its env
    (`waiting="env"`: steps that never end in the window, so each session is parked after
    `park_after_s`) or on its engine (a prefill that never ends). Measured as the Python
    heap (tracemalloc) and the resident memory added from before the run starts to when
    all `level` episodes wait, after a full collection."""
    if waiting == "env":
        workload = dataclasses.replace(
            workload, env_latency_s=3600.0, env_sigma=0.01, env_latency_max_s=3600.0
        )
    else:
        engine = dataclasses.replace(workload.engine, prefill_s=3600.0)
        workload = dataclasses.replace(workload, engine=engine)
    c = await build_controller(level, workload, url)
    park_s = c.config.rollout.park_after_s or 0.0
    gc.collect()
    tracemalloc.start()
    heap0, rss0 = tracemalloc.get_traced_memory()[0], _rss_bytes()
    await c.executor.start()
    try:
        began = time.perf_counter()

        # Episodes waiting on the env have played one turn; those waiting on the engine
        # have sent their first request. Then (env) their sessions park.
        def settled() -> bool:
            if live_episodes(c.executor) < level:
                return False
            if waiting == "engine":
                return sum(e.in_flight for e in c.engines) == level
            # Every first reply answered, every session parked.
            answered = sum(e.stats.requests for e in c.engines)
            return answered >= level and sum(e.sessions for e in c.engines) == 0

        while time.perf_counter() - began < settle_s + park_s and not settled():
            await asyncio.sleep(0.2)
        gc.collect()
        heap1, rss1 = tracemalloc.get_traced_memory()[0], _rss_bytes()
        live = live_episodes(c.executor)
        parked = level - sum(e.sessions for e in c.engines)
    finally:
        tracemalloc.stop()
        await c.executor.stop("benchmark over")
        await c.pool.close()
        await c.db.dispose()
    return HeldMemory(level, waiting, live, max(0, parked), heap1 - heap0, rss1 - rss0)


# ---- reporting --------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def histogram(counts: Counter[int]) -> str:
    total = sum(counts.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counts.items())) or "-"


def staleness_summary(counts: Counter[int]) -> str:
    values = list(counts.elements())
    if not values:
        return "-"
    return f"{quantile(values, 0.5):.0f}/{quantile(values, 0.9):.0f}/{max(values)}"


def _waits(counts: list[int] | None) -> str:
    """p50/p99 of a wait histogram, in ms (each the upper edge of its doubling bucket)."""
    if not counts or not sum(counts):
        return "-"
    p50, p99 = (WaitHistogram.quantile(counts, q) for q in (0.5, 0.99))
    return f"<{1000 * (p50 or 0):,.0f}/<{1000 * (p99 or 0):,.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: Sequence[LevelResult]) -> list[str]:
    """The tables, as lines."""
    lines = [
        "| episodes | live | turns/s | ideal/s | achieved | CPU cores | CPU ms/turn | "
        "turn rows/s | episodes/s | traj/s | trained/s | staleness p50/p90/max |",
        "|" + "---|" * 12,
    ]
    for r in results:
        lines.append(
            f"| {r.level:,} | {r.live_mean:,.0f} | {r.turns_per_s:,.0f} | {r.ideal_per_s:,.0f} "
            f"| {r.achieved:.0%} | {r.cores:.2f} | {r.cpu_ms_per_turn:.2f} "
            f"| {r.rows_per_s:,.0f} | {r.episodes_finished / r.window_s:,.1f} "
            f"| {r.trajectories_created / r.window_s:,.1f} | {r.consumed / r.window_s:,.1f} "
            f"| {staleness_summary(r.staleness)} |"
        )
    lines += [
        "",
        "| episodes | loop lag p50/p99 ms | GC CPU (full) | SQL statements/turn "
        "| turns queued to commit p50/max | a turn's write waits p50/p99 ms "
        "| an episode's end waits p50/p99 ms | connections p50/max | episode p50 s | versions "
        "| machine / postgres cores |",
        "|" + "---|" * 11,
    ]
    for r in results:
        lag = f"{1000 * quantile(r.lag_s, 0.5):.0f}/{1000 * quantile(r.lag_s, 0.99):.0f}"
        gc_share = r.gc_s / r.cpu_s if r.cpu_s else 0.0
        queued = f"{quantile(r.queued_turns, 0.5):,.0f}/{max(r.queued_turns, default=0):,}"
        conns = f"{quantile(r.connections, 0.5):.0f}/{max(r.connections, default=0)}"
        lines.append(
            f"| {r.level:,} | {lag} | {gc_share:.0%} ({r.gc_full}) "
            f"| {sum(r.statements.values()) / max(1, r.played):.1f} | {queued} "
            f"| {_waits(r.write_waits.get('turns'))} "
            f"| {_waits(r.write_waits.get('episode_ends'))} | {conns} "
            f"| {quantile(r.episode_s, 0.5):.1f} | {r.versions} "
            f"| {_fmt(r.machine_cores, '.2f')} / {_fmt(r.db_cores, '.2f')} |"
        )
    if len(results) > 1:
        lines += [
            "",
            "| growth | episodes | live | turns/s | CPU cores | CPU ms/turn | turn rows/s | "
            "episodes/s | trained/s | staleness p90 |",
            "|" + "---|" * 10,
        ]
        for a, b in zip(results, results[1:], strict=False):

            def x(f: Callable[[LevelResult], float], a: LevelResult = a, b: LevelResult = b) -> str:
                return f"x{f(b) / f(a):.2f}" if f(a) else "-"

            p90 = [quantile(list(r.staleness.elements()), 0.9) for r in (a, b)]
            lines.append(
                f"| {a.level:,} → {b.level:,} | x{b.level / a.level:.0f} "
                f"| {x(lambda r: r.live_mean)} | {x(lambda r: r.turns_per_s)} "
                f"| {x(lambda r: r.cores)} | {x(lambda r: r.cpu_ms_per_turn)} "
                f"| {x(lambda r: r.rows_per_s)} | {x(lambda r: r.episodes_finished)} "
                f"| {x(lambda r: r.consumed)} | {p90[0]:.0f} → {p90[1]:.0f} |"
            )
    lines.append("")
    for r in results:
        lines.append(
            f"{r.level:,}: staleness {histogram(r.staleness)}; episodes {r.statuses}; "
            f"dropped stale {r.dropped_stale}; continued after an abort {r.resubmitted}; "
            f"modeled turn {r.ideal_turn_s:.2f} s; warm-up {r.warmup_s:.0f} s; "
            f"stop took {r.teardown_s:.1f} s; logged {r.logged or 'nothing'}"
        )
        top = ", ".join(
            f"{k} {v / r.window_s:.1f}/s {1000 * r.statement_s[k] / v:.1f} ms"
            for k, v in r.statements.most_common(8)
        )
        lines.append(f"{r.level:,}: SQL statements (per second, mean wall time): {top}")
    return lines


def verdict(results: Sequence[LevelResult]) -> str:
    top = max(results, key=lambda r: r.level)
    if top.cores < 0.9 and top.achieved > 0.9:
        return (
            f"at {top.level:,} concurrent episodes the controller used {top.cores:.2f} cores "
            f"and kept up with the workload ({top.achieved:.0%} of the ideal turn rate)"
        )
    first = next((r for r in results if r.cores >= 0.9 or r.achieved < 0.9), top)
    ceiling = 1000 / top.cpu_ms_per_turn
    return (
        f"saturated: at {first.level:,} concurrent episodes the controller used "
        f"{first.cores:.2f} cores and made {first.achieved:.0%} of the ideal turn rate; at "
        f"{top.cpu_ms_per_turn:.2f} ms of CPU per turn one core sustains about "
        f"{ceiling:,.0f} turns/s"
    )


# ---- the profile ------------------------------------------------------------------------------

_BUCKETS = (
    ("sqlalchemy", "sqlalchemy"),
    ("asyncpg", "asyncpg"),
    ("aiosqlite", "aiosqlite"),
    ("pydantic", "pydantic"),
    ("asyncio", "asyncio"),
    ("uvloop", "uvloop"),
    ("agentflow/db/", "agentflow.db"),
    ("agentflow/rollout/", "agentflow.rollout"),
    ("agentflow/agents/", "agentflow.agents"),
    ("agentflow/inference/", "agentflow.inference"),
    ("agentflow/tokenization/", "agentflow.tokenization"),
    ("agentflow/", "agentflow (other)"),
    ("envs/", "envs"),
    ("bench/", "bench (simulators)"),
)


def profile_lines(profile: cProfile.Profile, top: int = 25) -> list[str]:
    """The top functions by own time and by cumulative time, and own time by package."""
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    by_bucket: Counter[str] = Counter()
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, _, own, _, _) in raw.items():
        name = filename.replace("\\", "/")
        bucket = next((b for key, b in _BUCKETS if key in name), None)
        if bucket is None:
            bucket = "builtins (C)" if name == "~" else "other Python"
        by_bucket[bucket] += own
    total = sum(by_bucket.values()) or 1.0
    lines = out.getvalue().splitlines()
    lines.append("own time by package:")
    for bucket, own in by_bucket.most_common():
        lines.append(f"  {bucket:<26}{own:8.2f} s {100 * own / total:5.1f}%")
    return lines


# ---- running it -------------------------------------------------------------------------------


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    """`url` (migrated to head), or a scratch PostgreSQL database dropped afterwards."""
    if url is None:
        with scratch_database(prefix="agentflow_bench_scale") as scratch:
            yield scratch
        return
    migrate.upgrade(url)
    yield url


def on_loop(kind: str, coro: Any, *, timeout_s: float | None = None) -> Any:
    """Run `coro` on a fresh event loop of `kind` (`asyncio` or `uvloop`). Past
    `timeout_s` every task's stack is printed to stderr and TimeoutError raised (the
    smoke tests' guard against a run that never ends)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if kind == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop

    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(main := asyncio.ensure_future(coro)),
                                          timeout_s)  # fmt: skip
        except TimeoutError:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.print_stack(file=sys.stderr)
            main.cancel()
            raise

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(bounded() if timeout_s is not None else coro)


def memory_lines(held: Sequence[HeldMemory]) -> list[str]:
    lines = [
        "| episodes | waiting on | live | sessions parked | Python heap per episode "
        "| resident memory per episode |",
        "|---|---|---|---|---|---|",
    ]
    for h in held:
        lines.append(
            f"| {h.level:,} | {h.waiting} | {h.live:,} | {h.parked:,} "
            f"| {h.python_bytes / max(1, h.live) / 1024:.1f} KiB "
            f"| {h.rss_bytes / max(1, h.live) / 1024:.1f} KiB |"
        )
    return lines


def run(
    level: int,
    workload: Workload,
    url: str,
    *,
    warmup_s: float,
    seconds: float,
    max_warmup_s: float = 150.0,
    loop: str = "asyncio",
    profile: cProfile.Profile | None = None,
    progress: Callable[[str], None] = lambda line: None,
    timeout_s: float | None = None,
) -> LevelResult:
    """`run_level` on a fresh event loop of kind `loop` (`asyncio` or `uvloop`)."""
    return on_loop(
        loop,
        run_level(
            level,
            workload,
            url,
            warmup_s=warmup_s,
            seconds=seconds,
            max_warmup_s=max_warmup_s,
            profile=profile,
            progress=progress,
        ),
        timeout_s=timeout_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--levels", default="100,1000,10000", help="concurrent episodes")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured, per level")
    parser.add_argument("--warmup", type=float, default=15.0, help="at least, before measuring")
    parser.add_argument("--max-warmup", type=float, default=150.0, help="at most")
    parser.add_argument("--engines", type=int, default=100, help="simulated engines")
    parser.add_argument("--slots", type=int, default=128, help="batch slots per engine")
    parser.add_argument("--train-s", type=float, default=0.5, help="simulated train step")
    parser.add_argument("--batch-fraction", type=float, default=0.5, help="batch / level")
    parser.add_argument("--max-batch", type=int, default=1024, help="largest trainer batch")
    parser.add_argument(
        "--max-staleness", type=int, default=None, help="default: ceil(2.5 * level / batch)"
    )
    parser.add_argument("--group", type=int, default=8, help="samples per task")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    parser.add_argument(
        "--database-url", default=None, help="default: a scratch PostgreSQL database per level"
    )
    parser.add_argument("--profile", action="store_true", help="then one level under cProfile")
    parser.add_argument("--profile-level", type=int, default=None, help="default: the largest")
    parser.add_argument("--profile-seconds", type=float, default=15.0)
    parser.add_argument("--profile-out", default=None, help="also dump the pstats here")
    parser.add_argument("--skip-levels", action="store_true", help="only the profile")
    parser.add_argument(
        "--controllers",
        default="",
        help="then each level again with this many controller shards each (e.g. 1,2): "
        "processes that share the run (bench/scale_shards.py)",
    )
    parser.add_argument(
        "--memory",
        default="",
        help="levels at which to measure the memory a live episode holds (e.g. 1000,10000)",
    )
    parser.add_argument(
        "--gc-threshold",
        default=Settings().gc_threshold,
        help="the cyclic garbage collector's thresholds; default: the gateway's "
        "(AGENTFLOW_GC_THRESHOLD); '' for Python's own "
        f"({','.join(map(str, gc.get_threshold()))})",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(FirstOfEach())
    Settings(gc_threshold=args.gc_threshold).apply_gc_threshold()  # as the gateway does
    register_env()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    workload = Workload(
        engines=args.engines,
        engine=EngineModel(slots=args.slots),
        group_size=args.group,
        max_staleness=args.max_staleness,
        batch_fraction=args.batch_fraction,
        max_batch=args.max_batch,
        train_s=args.train_s,
    )
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"{args.engines} engines of {args.slots} slots; loop {args.loop}; "
        f"gc thresholds {gc.get_threshold()}; "
        f"db {'scratch PostgreSQL' if args.database_url is None else args.database_url}",
        flush=True,
    )

    def say(line: str) -> None:
        print("  " + line, flush=True)

    def measure(level: int, seconds: float, profile: cProfile.Profile | None = None) -> LevelResult:
        with database(args.database_url) as url:
            return run(
                level,
                workload,
                url,
                warmup_s=args.warmup,
                seconds=seconds,
                max_warmup_s=args.max_warmup,
                loop=args.loop,
                profile=profile,
                progress=say,
            )

    results: list[LevelResult] = []
    for level in [] if args.skip_levels else levels:
        result = measure(level, args.seconds)
        results.append(result)
        say(
            f"level {level}: {result.turns_per_s:,.0f} turns/s, {result.cores:.2f} cores, "
            f"{result.cpu_ms_per_turn:.2f} ms CPU/turn"
        )
    if results:
        print(
            f"\nmeasured {args.seconds:.0f} s per level after a warm-up of at least "
            f"{args.warmup:.0f} s; groups of {args.group}, train step {args.train_s} s; "
            "trainer batch (episodes) / max_staleness: "
            + ", ".join(f"{workload.batch(n)}/{workload.staleness(n)}" for n in levels)
            + "\n"
        )
        print("\n".join(report(results)))
        print("\n" + verdict(results))
    if args.controllers:
        sharded = []
        for level in levels:
            for count in (int(x) for x in args.controllers.split(",") if x.strip()):
                with database(args.database_url) as url:
                    sharded.append(
                        on_loop(
                            args.loop,
                            run_sharded_level(
                                level,
                                count,
                                workload,
                                url,
                                warmup_s=args.warmup,
                                seconds=args.seconds,
                                max_warmup_s=args.max_warmup,
                                progress=say,
                            ),
                        )
                    )
                r = sharded[-1]
                say(
                    f"level {level}, {count} shards: {r.turns_per_s:,.0f} turns/s, "
                    f"{r.cores:.2f} cores, {r.cpu_ms_per_turn:.2f} ms CPU/turn"
                )
        print(
            "\ncontroller shards (every controller process's CPU; turns counted from the "
            "env turn rows written in the window):\n"
        )
        print("\n".join(sharded_report(sharded)))
    if args.memory:
        held = []
        for level in (int(x) for x in args.memory.split(",") if x.strip()):
            for waiting in ("env", "engine"):
                with database(args.database_url) as url:
                    held.append(
                        on_loop(args.loop, held_memory(level, workload, url, waiting=waiting))
                    )
                say(f"memory at {level}: {waiting} measured")
        print(
            "\nmemory held by live episodes (each waiting on its env with its session "
            "parked, or on its engine), from before the run starts; the resident column "
            "means something only in a process that ran nothing before (--skip-levels): "
            "one that did reuses the memory it freed:\n"
        )
        print("\n".join(memory_lines(held)))
    if args.profile:
        level = args.profile_level or max(levels)
        # CPU time, not wall time: the idle loop's waits are not anyone's cost.
        profile = cProfile.Profile(time.process_time)
        result = measure(level, args.profile_seconds, profile)
        print(
            f"\nprofile of {level:,} concurrent episodes, {args.profile_seconds:.0f} s "
            f"(under cProfile: {result.turns_per_s:,.0f} turns/s, {result.cores:.2f} cores); "
            f"the garbage collector took {result.gc_s:.1f} s of CPU ({result.gc_full} full "
            "collections), charged to whichever functions allocated when it ran"
        )
        print("\n".join(profile_lines(profile)))
        if args.profile_out:
            profile.dump_stats(args.profile_out)


if __name__ == "__main__":
    main()
