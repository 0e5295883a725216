"""`RunExecutor`: the rollout scheduler of one run (DESIGN §6).

Tasks are drawn from the env mix (weighted, seeded); each task is played `group_size`
times (one group, for group-normalized advantages). Admission, in order:
- the `StalenessGate` (unless `rollout.wait_for_trainer` is off): at most
  `(version + max_staleness + 1)` trainer batches of groups are ever admitted while
  the trainer is at `version`;
- the pool: at most `rollout.max_concurrency` live episodes, or, with
  `rollout.elastic`, a limit the `ElasticPool` moves with measured load within
  `[min_concurrency, max_concurrency]`;
- each env's own cap.
Queued tasks are never materialized ahead of admission, so a burst of work cannot push
the scheduler past its caps.

Weight updates go through `update_weights`: the run's runtime interrupts (partial
rollout) or drains its generations, the new version is recorded, and the gate opens.

Every episode ends in the database as completed, truncated, failed or aborted with its
reason: a failing env, agent or engine fails that episode, never the run; a run whose
episodes fail `max_consecutive_failures` times in a row is failed with the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import String, func, insert, select, update

from agentflow.agents.base import Agent, Budget, EpisodeHandle, EpisodeOutcome
from agentflow.agents.keys import episode_key
from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.models import Episode, Run, Trajectory, WeightVersion
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict
from agentflow.inference.base import WeightUpdate
from agentflow.rollout.elastic import ElasticLimit, ElasticPool
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.gate import StalenessGate
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import RunConfig

log = logging.getLogger(__name__)

RunState = Literal["running", "paused", "stopped", "finished", "failed"]


@dataclass
class RunCounters:
    started: int = 0
    groups: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    last_error: str | None = None
    weight_updates: int = 0
    update_seconds: float = 0.0


@dataclass
class _Group:
    """One task's samples; refunded to the gate if it yields no trajectory."""

    started: int = 0
    finished: int = 0
    trajectories: int = 0
    admitted_all: bool = False


class RunExecutor:
    """Plays episodes for one run until `max_episodes`, a stop, or too many failures."""

    def __init__(
        self,
        run_id: uuid.UUID,
        config: RunConfig,
        *,
        turns: TurnTree,
        runtime: PolicyRuntime,
        sources: list[EnvSource],
        agent: Agent,
        gateway_url: str,
        secret_key: str,
        on_finish: Callable[[RunExecutor], Awaitable[None]] | None = None,
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.turns = turns
        self.sessions = turns.sessions
        self.runtime = runtime
        self.sources = sources
        self.agent = agent
        self.gateway_url = gateway_url
        self.secret_key = secret_key
        self.on_finish = on_finish
        self.state: RunState = "running"
        self.counters = RunCounters()
        self._rng = random.Random(config.seed)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        rollout = config.rollout
        self.gate: StalenessGate | None = None
        if rollout.wait_for_trainer:
            self.gate = StalenessGate(
                max_staleness=rollout.max_staleness,
                batch_episodes=config.trainer.batch_episodes,
                group_size=rollout.group_size,
            )
        first = min(rollout.max_concurrency, max(rollout.min_concurrency, 64))
        self._slots = ElasticLimit(first if rollout.elastic else rollout.max_concurrency)
        self.pool: ElasticPool | None = None
        if rollout.elastic:
            self.pool = ElasticPool(
                self._slots,
                min_concurrency=rollout.min_concurrency,
                max_concurrency=rollout.max_concurrency,
                engine_slots=self._engine_slots,
                generating=runtime.load.take_mean,
            )
        self.weight_version = 0
        self._env_slots = [asyncio.Semaphore(s.max_concurrency) for s in sources]
        self._live: set[asyncio.Task[None]] = set()  # one per episode, never cancelled
        self._agents: set[asyncio.Task[EpisodeOutcome]] = set()  # cancelled on a stop
        self._main: asyncio.Task[None] | None = None
        self._stop_reason: str | None = None
        self._ending = False

    # ---- control --------------------------------------------------------------------

    async def start(self, *, paused: bool = False) -> None:
        await self._restore_version()
        if paused:
            await self.pause()
        else:
            await self._set_status("running")
        if self.pool is not None:
            self.pool.start()
        self._main = asyncio.create_task(self._admit_loop(), name=f"run-{self.run_id}")

    async def update_weights(self, update: WeightUpdate) -> int:
        """Switch the run's engine to new weights, record the version, open the gate."""
        self._require_live()
        started = asyncio.get_running_loop().time()
        version = await self.runtime.update_weights(update)
        seconds = asyncio.get_running_loop().time() - started
        self.counters.weight_updates += 1
        self.counters.update_seconds += seconds
        async with self.sessions.begin() as session:
            await session.execute(update_run_version(self.run_id, version))
            await session.execute(
                insert(WeightVersion).values(
                    run_id=self.run_id,
                    version=version,
                    uri=update.path or "inprocess",
                    metrics={"switch_seconds": seconds},
                    created_at=datetime.now(UTC),
                )
            )
        self.weight_version = version
        if self.gate is not None:
            await self.gate.advance(version)
        return version

    def trajectory_stream(self) -> DbTrajectoryStream:
        """The run's trajectory stream, wired to this scheduler's gate."""
        rollout = self.config.rollout
        stream = DbTrajectoryStream(
            self.turns,
            self.run_id,
            group_size=rollout.group_size,
            max_staleness=rollout.max_staleness if rollout.wait_for_trainer else None,
            max_reuse=rollout.max_reuse,
            stale_policy=rollout.stale_policy,
            lease_s=rollout.lease_s,
        )
        stream.on_group_dropped(self.refund_group)
        stream.on_taken(self.groups_taken)
        return stream

    async def refund_group(self) -> None:
        """A group lost all its trajectories (dropped as stale): admit another."""
        if self.gate is not None:
            await self.gate.refund_group()

    async def _restore_version(self) -> None:
        """After a restart: the trainer's version, and the groups admitted and trained."""
        group = func.coalesce(Episode.group_id, func.cast(Episode.id, String))
        async with self.sessions() as session:
            version = await session.scalar(select(Run.weight_version).where(Run.id == self.run_id))
            admitted = await session.scalar(
                select(func.count(func.distinct(group)))
                .select_from(Trajectory)
                .join(Episode, Episode.id == Trajectory.episode_id)
                .where(Trajectory.run_id == self.run_id)
                .where(Trajectory.status.in_(("ready", "leased", "consumed")))
            )
            taken = await session.scalar(
                select(func.count(func.distinct(group)))
                .select_from(Trajectory)
                .join(Episode, Episode.id == Trajectory.episode_id)
                .where(Trajectory.run_id == self.run_id)
                .where(Trajectory.lease_id.is_not(None) | (Trajectory.times_served > 0))
            )
        self.weight_version = version or 0
        if self.gate is not None:
            self.gate.resume_from(self.weight_version, admitted or 0, taken or 0)

    async def groups_taken(self, n: int) -> None:
        """The trainer leased `n` fresh groups for the first time."""
        if self.gate is not None:
            await self.gate.groups_taken(n)

    async def _engine_slots(self) -> tuple[int, int]:
        info = await self.runtime.engine.info()
        slots = info.extra.get("max_batch_size") or max(info.running, 1)
        return int(slots), info.waiting

    async def pause(self) -> None:
        """Admit no new episodes; live ones finish."""
        self._require_live()
        self._unpaused.clear()
        self.state = "paused"
        await self._set_status("paused")

    async def resume(self) -> None:
        self._require_live()
        self._unpaused.set()
        self.state = "running"
        await self._set_status("running")

    async def stop(self, reason: str = "run stopped") -> None:
        """Abort live episodes (recorded with `reason`) and end the run as stopped."""
        if self.state in ("stopped", "finished", "failed"):
            return
        await self._end("stopped", reason)

    async def halt(self, reason: str) -> None:
        """Abort live episodes but leave the run's status, so a restart picks it up again."""
        await self._end(self.state, reason, record=False)

    async def wait(self) -> None:
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._main)

    def _require_live(self) -> None:
        if self.state not in ("running", "paused"):
            raise Conflict(f"run {self.run_id} is {self.state}")

    # ---- the loop -------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        rollout = self.config.rollout
        try:
            while rollout.max_episodes is None or self.counters.started < rollout.max_episodes:
                await self._unpaused.wait()
                if self.gate is not None:
                    await self.gate.admit_group()
                source_index = self._pick_source()
                task: dict[str, object] = {"seed": self._rng.randrange(2**31)}
                group_id = uuid.uuid4().hex
                group = _Group()
                self.counters.groups += 1
                for _ in range(rollout.group_size):
                    if rollout.max_episodes and self.counters.started >= rollout.max_episodes:
                        break
                    await self._unpaused.wait()
                    await self._slots.acquire()
                    await self._env_slots[source_index].acquire()
                    self.counters.started += 1
                    group.started += 1
                    episode = asyncio.create_task(self._play(source_index, task, group_id, group))
                    self._live.add(episode)
                    episode.add_done_callback(self._live.discard)
                group.admitted_all = True
                await self._settle_group(group)
            while self._live:
                await asyncio.wait(set(self._live))
            await self._end("finished", None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the run fails with the reason recorded
            log.exception("run %s admission failed", self.run_id)
            await self._end("failed", f"{type(exc).__name__}: {exc}")

    def _pick_source(self) -> int:
        weights = [s.weight for s in self.sources]
        return self._rng.choices(range(len(self.sources)), weights=weights)[0]

    async def _play(
        self, source_index: int, task: dict[str, object], group_id: str, group: _Group
    ) -> None:
        """One episode, start to record. Never cancelled itself: a stop cancels only the
        agent's task, so creating and completing the episode always run to the end."""
        source = self.sources[source_index]
        episode_id: uuid.UUID | None = None
        try:
            episode_id = await self.turns.create_episode(
                run_id=self.run_id,
                environment_id=source.environment_id,
                env_ref=source.ref,
                task=task,
                group_id=group_id,
            )
            if self._ending:
                outcome = EpisodeOutcome("aborted", None, self._stop_reason or "run stopped")
            else:
                agent = asyncio.create_task(self._run_agent(episode_id, source, task))
                self._agents.add(agent)
                try:
                    outcome = await agent
                except asyncio.CancelledError:
                    outcome = EpisodeOutcome("aborted", None, self._stop_reason or "run stopped")
                finally:
                    self._agents.discard(agent)
        except Exception as exc:  # noqa: BLE001 - the episode fails, not the run
            outcome = EpisodeOutcome("failed", None, f"{type(exc).__name__}: {exc}")
        finally:
            self._slots.release()
            self._env_slots[source_index].release()
        if episode_id is not None:
            group.trajectories += await self._complete(episode_id, outcome)
        group.finished += 1
        await self._settle_group(group)

    async def _settle_group(self, group: _Group) -> None:
        if group.admitted_all and group.finished == group.started and not group.trajectories:
            group.trajectories = -1  # refund once
            await self.refund_group()

    async def _run_agent(
        self, episode_id: uuid.UUID, source: EnvSource, task: dict[str, object]
    ) -> EpisodeOutcome:
        env = source.make()
        try:
            handle = EpisodeHandle(
                episode_id=episode_id,
                run_id=self.run_id,
                env=env,
                runtime=self.runtime,
                turns=self.turns,
                task=dict(task),
                budget=Budget(
                    max_turns=self.config.agent.max_turns, max_tokens=self.config.agent.max_tokens
                ),
                gateway_url=self.gateway_url,
                api_key=episode_key(episode_id, self.secret_key),
                step_timeout_s=source.step_timeout_s,
            )
            return await self.agent.run(handle)
        finally:
            with contextlib.suppress(Exception):
                await env.close()

    async def _complete(self, episode_id: uuid.UUID, outcome: EpisodeOutcome) -> int:
        """Record the outcome; returns how many trajectories it made."""
        counters = self.counters
        counters.by_status[outcome.status] = counters.by_status.get(outcome.status, 0) + 1
        if outcome.status == "failed":
            counters.consecutive_failures += 1
            counters.last_error = outcome.error
        elif outcome.status in ("completed", "truncated"):
            counters.consecutive_failures = 0
        made = 0
        try:
            made = len(
                await self.turns.complete_episode(
                    episode_id,
                    outcome.status,
                    outcome.reward,
                    leaf_turn_ids=outcome.leaf_turn_ids,
                    error=outcome.error,
                )
            )
        except Conflict:
            made = await self._trajectory_count(episode_id)  # finished by a black-box callback
        except Exception:  # noqa: BLE001 - logged; recovery aborts it on the next start
            log.exception("could not complete episode %s", episode_id)
        limit = self.config.rollout.max_consecutive_failures
        if counters.consecutive_failures >= limit and self.state in ("running", "paused"):
            reason = f"{limit} episodes failed in a row; last: {counters.last_error}"
            asyncio.get_running_loop().create_task(self._end("failed", reason))
        return made

    async def _trajectory_count(self, episode_id: uuid.UUID) -> int:
        async with self.sessions() as session:
            count = await session.scalar(
                select(func.count())
                .select_from(Trajectory)
                .where(Trajectory.episode_id == episode_id)
            )
        return int(count or 0)

    # ---- ending ---------------------------------------------------------------------

    async def _end(self, state: RunState, reason: str | None, *, record: bool = True) -> None:
        if self.state in ("stopped", "finished", "failed") or self._ending:
            return
        self._ending = True
        self.state = state
        self._stop_reason = reason
        if self.pool is not None:
            await self.pool.stop()
        current = asyncio.current_task()
        if self._main is not None and self._main is not current:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._main
        for agent in list(self._agents):
            agent.cancel()
        # Every episode records its outcome before the run's own status changes.
        await asyncio.gather(*[t for t in self._live if t is not current], return_exceptions=True)
        if record:
            await self._set_status(state, error=reason if state == "failed" else None)
        if self.on_finish is not None:
            await self.on_finish(self)

    async def _set_status(self, status: str, *, error: str | None = None) -> None:
        async with self.sessions.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id == self.run_id)
                .values(status=status, error=error, updated_at=datetime.now(UTC))
            )


def update_run_version(run_id: uuid.UUID, version: int) -> Any:
    return (
        update(Run)
        .where(Run.id == run_id)
        .values(weight_version=version, updated_at=datetime.now(UTC))
    )
