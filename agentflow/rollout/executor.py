"""`RunExecutor`: the rollout scheduler of one run (docs/architecture.md, "Asynchrony
and staleness").

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
reason: a failing env, agent, engine or reward function fails that episode, never the
run; a run whose episodes fail `max_consecutive_failures` times in a row is failed with
the last error.

Plug-ins (`agentflow.plugins`): an env entry's `reward` function rescores its completed
and truncated episodes before they are recorded; each of `rollout.hooks` is called once an
episode is recorded, and one that raises is logged and counted (`hook_errors`), no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import numbers
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from agentflow import ids
from agentflow.agents.base import Agent, Budget, EpisodeHandle, EpisodeOutcome
from agentflow.agents.keys import episode_key
from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.runs import IN_PROCESS_URI, RunStore
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict
from agentflow.inference.base import WeightUpdate
from agentflow.plugins import EpisodeEvent, RewardInput, call, load_function
from agentflow.rollout.elastic import ElasticLimit, ElasticPool
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.gate import StalenessGate
from agentflow.rollout.lanes import EnvLane, EnvLanes, LanePlan
from agentflow.rollout.mix import SourceMix
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import RunConfig

log = logging.getLogger(__name__)

RunState = Literal["running", "paused", "stopped", "finished", "failed"]

_COMPLETE_ATTEMPTS = 5  # writing an episode's end: 0.5 + 1 + 2 + 4 s between tries
_COMPLETE_RETRY_S = 0.5


@dataclass
class RunCounters:
    started: int = 0
    groups: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    last_error: str | None = None
    weight_updates: int = 0
    update_seconds: float = 0.0
    hook_errors: int = 0

    def count_episode(self, status: str, error: str | None) -> None:
        """An episode ended with `status`: a failure extends the run of failures, a
        completed or truncated episode ends it."""
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if status == "failed":
            self.consecutive_failures += 1
            self.last_error = error
        elif status in ("completed", "truncated"):
            self.consecutive_failures = 0


@dataclass(frozen=True)
class GroupTicket:
    """One admitted group: which env (its lane's key, `agentflow.rollout.lanes`), which
    task, how many episodes (`group_size`, fewer for the last group of a run that stops
    at `max_episodes`)."""

    group_id: str
    env: str
    task: dict[str, object]
    episodes: int


class GroupAdmission(Protocol):
    """Where a scheduler gets its next group. `LocalAdmission` decides in this process; a
    controller shard asks its run's coordinator (`agentflow.rollout.shards`), which keeps
    the one staleness gate, env mix and task sequence of the run."""

    async def next_group(self) -> GroupTicket | None:
        """Wait until a group may start; None once the run has admitted its last."""
        ...

    async def group_settled(self, ticket: GroupTicket, trajectories: int) -> None:
        """Every episode of `ticket` has been recorded; `trajectories` made in all."""
        ...


class LocalAdmission:
    """The run's admission decided here: the staleness gate, the env mix's next pick, a
    seeded task, and `rollout.max_episodes`. A group with no trajectory is refunded."""

    def __init__(
        self, config: RunConfig, mix: list[tuple[str, float]], gate: StalenessGate | None
    ) -> None:
        self.gate = gate
        self.group_size = config.rollout.group_size
        self.max_episodes = config.rollout.max_episodes
        self.granted = 0  # episodes in the groups admitted so far
        self._rng = random.Random(config.seed)
        self.set_mix(mix)

    def set_mix(self, mix: list[tuple[str, float]]) -> None:
        """The next groups come from `mix` (lane key, weight); the task sequence goes on."""
        self._keys = [key for key, _ in mix]
        self._mix = SourceMix([weight for _, weight in mix])

    @property
    def exhausted(self) -> bool:
        return self.max_episodes is not None and self.granted >= self.max_episodes

    async def next_group(self) -> GroupTicket | None:
        if self.exhausted:
            return None
        if self.gate is not None:
            await self.gate.admit_group()
        episodes = self.group_size
        if self.max_episodes is not None:
            episodes = min(episodes, self.max_episodes - self.granted)
        self.granted += episodes
        env = self._keys[self._mix.pick()]
        task: dict[str, object] = {"seed": self._rng.randrange(2**31)}
        return GroupTicket(ids.new_hex(), env, task, episodes)

    async def group_settled(self, ticket: GroupTicket, trajectories: int) -> None:
        if trajectories == 0 and self.gate is not None:
            await self.gate.refund_group()


EpisodeReport = Callable[[EpisodeOutcome, int], None]


@dataclass
class _Group:
    """One task's samples; settled once all have ended (refunded to the gate if it yields
    no trajectory)."""

    ticket: GroupTicket
    started: int = 0
    finished: int = 0
    trajectories: int = 0
    admitted_all: bool = False
    settled: bool = False


class RunExecutor:
    """Plays episodes for one run until `max_episodes`, a stop, or too many failures."""

    def __init__(
        self,
        run_id: uuid.UUID,
        config: RunConfig,
        *,
        turns: TurnTree,
        runs: RunStore | None = None,
        runtime: PolicyRuntime,
        sources: list[EnvSource],
        agent: Agent,
        gateway_url: str,
        secret_key: str,
        on_finish: Callable[[RunExecutor], Awaitable[None]] | None = None,
        admission: GroupAdmission | None = None,
        on_episode: EpisodeReport | None = None,
        owns_run: bool = True,
    ) -> None:
        """`admission`: where groups come from (default: decided here, with this run's
        gate). A controller shard passes its coordinator's, with `owns_run` off: the
        coordinator then writes the run's status and fails the run after
        `max_consecutive_failures`, counting the episodes `on_episode` reports."""
        self.run_id = run_id
        self.config = config
        self.turns = turns
        self.runs = runs or RunStore(turns.sessions)
        self.runtime = runtime
        self.agent = agent
        self.gateway_url = gateway_url
        self.secret_key = secret_key
        self.on_finish = on_finish
        # `sources` are `config.envs` resolved, in order.
        self.lanes = EnvLanes(config.envs, sources)
        self._hooks = [
            (path, load_function(path, field=("rollout", "hooks", str(i))))
            for i, path in enumerate(config.rollout.hooks)
        ]
        self._hooks_failed: set[str] = set()
        self.state: RunState = "running"
        self.counters = RunCounters()
        self.owns_run = owns_run
        self.on_episode = on_episode
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        rollout = config.rollout
        self.gate: StalenessGate | None = None
        if rollout.wait_for_trainer and admission is None:
            self.gate = StalenessGate(
                max_staleness=rollout.max_staleness,
                batch_episodes=config.trainer.batch_episodes,
                # A group's trajectories, RTPO's re-rolls included: the trainer's unit.
                group_size=config.samples_per_group(),
            )
        self.admission = admission or LocalAdmission(config, self.lanes.mix, self.gate)
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
        self._live: set[asyncio.Task[None]] = set()  # one per episode, never cancelled
        self._agents: set[asyncio.Task[EpisodeOutcome]] = set()  # cancelled on a stop
        self._main: asyncio.Task[None] | None = None
        self._stop_reason: str | None = None
        self._ending = False
        self._ended = asyncio.Event()  # every episode recorded, the run's end handled

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
        uri = update.uri or IN_PROCESS_URI
        await self.runs.record_version(self.run_id, version, uri, {"switch_seconds": seconds})
        self.weight_version = version
        if self.gate is not None:
            await self.gate.advance(version)
        return version

    def prepare_envs(self, config: RunConfig, sources: list[EnvSource]) -> LanePlan:
        """`config`'s env mix (`sources`, its entries resolved) checked and ready for
        `apply_envs`."""
        self._require_live()
        return self.lanes.prepare(config.envs, sources)

    async def apply_envs(self, config: RunConfig, plan: LanePlan) -> None:
        """The groups admitted from now on come from `plan`'s mix; the groups admitted
        before play on in their envs (`agentflow.rollout.lanes`)."""
        self.config = config
        self.lanes.apply(plan)
        if isinstance(self.admission, LocalAdmission):
            self.admission.set_mix(self.lanes.mix)

    def trajectory_stream(self) -> DbTrajectoryStream:
        """The run's trajectory stream, wired to this scheduler's gate."""
        return run_stream(self.turns, self.run_id, self.config, gate=self.gate)

    async def _restore_version(self) -> None:
        """After a restart: the trainer's version, and the groups admitted and trained."""
        point = await self.runs.restore_point(self.run_id)
        self.weight_version = point.version
        if self.gate is not None:
            self.gate.resume_from(point.version, point.groups_admitted, point.groups_taken)

    def free_groups(self) -> int:
        """Whole groups that could start now: free episode slots over the group size."""
        return max(0, self._slots.limit - self._slots.held) // self.config.rollout.group_size

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
        """Until admission has ended; see `ended` for the end of the last episode too."""
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._main)

    async def ended(self) -> None:
        """Until the run has ended here: admission over and every episode recorded (a stop
        cancels admission first, then waits for the live episodes)."""
        await self._ended.wait()

    def _require_live(self) -> None:
        if self.state not in ("running", "paused"):
            raise Conflict(f"run {self.run_id} is {self.state}")

    # ---- the loop -------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        try:
            while True:
                await self._unpaused.wait()
                ticket = await self.admission.next_group()
                if ticket is None:
                    break
                group = _Group(ticket)
                self.counters.groups += 1
                for _ in range(ticket.episodes):
                    await self._unpaused.wait()
                    await self._slots.acquire()
                    await self.lanes[ticket.env].slots.acquire()
                    self.counters.started += 1
                    group.started += 1
                    episode = asyncio.create_task(self._play(group))
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

    async def _play(self, group: _Group) -> None:
        """One episode, start to record. Never cancelled itself: a stop cancels only the
        agent's task, so creating and completing the episode always run to the end."""
        task, group_id = group.ticket.task, group.ticket.group_id
        lane = self.lanes[group.ticket.env]
        source = lane.source
        episode_id: uuid.UUID | None = None
        try:
            episode_id = await self.turns.create_episode(
                run_id=self.run_id,
                environment_id=source.environment_id,
                env_ref=source.ref,
                task=task,
                group_id=group_id,
                gather=True,
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
            lane.slots.release()
        made = 0
        if episode_id is not None:
            outcome = await self._rescore(episode_id, lane, task, outcome)
            made = await self._complete(episode_id, outcome)
            group.trajectories += made
        group.finished += 1
        await self._settle_group(group)
        if episode_id is not None and self._hooks:
            event = EpisodeEvent(
                run_id=self.run_id,
                episode_id=episode_id,
                env=source.ref,
                status=outcome.status,
                reward=outcome.reward,
                error=outcome.error,
                trajectories=made,
            )
            await self._call_hooks(event)

    async def _settle_group(self, group: _Group) -> None:
        if group.admitted_all and group.finished == group.started and not group.settled:
            group.settled = True
            await self.admission.group_settled(group.ticket, group.trajectories)

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
                env_factory=source.make,
            )
            return await self.agent.run(handle)
        finally:
            with contextlib.suppress(Exception):
                await env.close()

    async def _rescore(
        self,
        episode_id: uuid.UUID,
        lane: EnvLane,
        task: dict[str, object],
        outcome: EpisodeOutcome,
    ) -> EpisodeOutcome:
        """The env entry's reward function, if any, replaces a finished episode's reward;
        one that raises or returns no finite number fails the episode, naming itself."""
        reward_fn = lane.reward
        if reward_fn is None or outcome.status not in ("completed", "truncated"):
            return outcome
        entry = lane.entry
        try:
            leaves = outcome.leaf_turn_ids
            if leaves is None:
                leaves = tuple(t.id for t in await self.turns.leaves(episode_id))
            decode = self.runtime.template.tokenizer.decode
            texts = tuple(decode(c.token_ids) for c in await self.turns.contexts(leaves))
            episode = RewardInput(
                run_id=self.run_id,
                episode_id=episode_id,
                env=entry.id,
                task=dict(task),
                status=outcome.status,
                env_reward=outcome.reward,
                texts=texts,
            )
            value = await call(reward_fn, episode)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
            ):
                raise ValueError(f"returned {value!r}, not a finite number")
        except Exception as exc:  # noqa: BLE001 - this episode fails, not the run
            error = f"reward function {entry.reward}: {type(exc).__name__}: {exc}"
            return EpisodeOutcome("failed", None, error, turns=outcome.turns)
        return dataclasses.replace(outcome, reward=float(value))

    async def _call_hooks(self, event: EpisodeEvent) -> None:
        for path, hook in self._hooks:
            try:
                await call(hook, event)
            except Exception:  # noqa: BLE001 - a hook never fails an episode or the run
                self.counters.hook_errors += 1
                if path not in self._hooks_failed:  # the first traceback is enough
                    self._hooks_failed.add(path)
                    log.exception("run %s: rollout hook %s raised", self.run_id, path)

    async def _complete(self, episode_id: uuid.UUID, outcome: EpisodeOutcome) -> int:
        """Record the outcome; returns how many trajectories it made."""
        counters = self.counters
        counters.count_episode(outcome.status, outcome.error)
        made = await self._record_outcome(episode_id, outcome)
        if self.on_episode is not None:
            self.on_episode(outcome, made)
        limit = self.config.rollout.max_consecutive_failures
        if (
            self.owns_run
            and counters.consecutive_failures >= limit
            and self.state in ("running", "paused")
        ):
            reason = f"{limit} episodes failed in a row; last: {counters.last_error}"
            asyncio.get_running_loop().create_task(self._end("failed", reason))
        return made

    async def _record_outcome(self, episode_id: uuid.UUID, outcome: EpisodeOutcome) -> int:
        """Write the episode's end; returns how many trajectories it made. A write that
        fails (a database that is briefly unreachable, a connection pool exhausted under
        load) is tried again with backoff: an episode left `running` would hold back its
        group from the trainer for the rest of the run."""
        delay = _COMPLETE_RETRY_S
        for attempt in range(1, _COMPLETE_ATTEMPTS + 1):
            try:
                return len(
                    await self.turns.complete_episode(
                        episode_id,
                        outcome.status,
                        outcome.reward,
                        leaf_turn_ids=outcome.leaf_turn_ids,
                        leaf_rewards=outcome.leaf_rewards,
                        error=outcome.error,
                        gather=True,
                    )
                )
            except Conflict:  # finished already: a black-box callback, or our lost answer
                return await self.runs.trajectory_count(episode_id)
            except Exception as exc:  # noqa: BLE001 - tried again, then logged
                if attempt == _COMPLETE_ATTEMPTS:
                    log.exception(
                        "could not complete episode %s in %d attempts; recovery aborts it "
                        "on the next start",
                        episode_id,
                        attempt,
                    )
                    return 0
                log.warning(
                    "completing episode %s failed (%s: %s); trying again in %.1f s",
                    episode_id,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

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
        self._ended.set()
        if self.on_finish is not None:
            await self.on_finish(self)

    async def _set_status(self, status: str, *, error: str | None = None) -> None:
        if self.owns_run:
            await self.runs.set_status(self.run_id, status, error=error)


def run_stream(
    turns: TurnTree,
    run_id: uuid.UUID,
    config: RunConfig,
    *,
    gate: StalenessGate | None = None,
) -> DbTrajectoryStream:
    """A run's trajectory stream as its config says (`gate`: its live scheduler's)."""
    rollout = config.rollout
    return DbTrajectoryStream(
        turns,
        run_id,
        group_size=rollout.group_size,
        max_staleness=rollout.max_staleness if rollout.wait_for_trainer else None,
        max_reuse=rollout.max_reuse,
        stale_policy=rollout.stale_policy,
        lease_s=rollout.lease_s,
        gate=gate,
    )
