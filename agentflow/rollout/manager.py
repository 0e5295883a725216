"""`RunManager`: the gateway's live runs, their engines, and recovery after a crash."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from agentflow.agents.base import Agent
from agentflow.agents.blackbox.container_agent import ContainerAgent
from agentflow.agents.blackbox.http_agent import HttpAgent
from agentflow.agents.blackbox.live import LiveEpisodes
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.config import Settings
from agentflow.db.runs import ENDED_RUN_STATUSES, EnvRevision, RunStore
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict, InvalidInput
from agentflow.inference.base import (
    BroadcastReceiver,
    WeightGroup,
    WeightUpdate,
)
from agentflow.metrics import GatewayMetrics
from agentflow.rollout.envs import EnvSource, resolve_env_sources
from agentflow.rollout.executor import RunExecutor, run_stream
from agentflow.rollout.mix import blame, revise_mix
from agentflow.rollout.runtime_setup import (
    build_runtime,
    load_newest_weights,
    python_agent,
    whitebox_agent,
)
from agentflow.rollout.shards.coordinator import ShardedRun
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import UNLOADED, EnvMixChange, RunConfig, with_envs

if TYPE_CHECKING:
    from agentflow.placement.env_servers import EnvServers

log = logging.getLogger(__name__)

RESTART_REASON = "the gateway restarted while the episode was live; its env session is gone"


class RunManager:
    def __init__(
        self,
        turns: TurnTree,
        runtimes: RuntimeRegistry,
        settings: Settings,
        *,
        live: LiveEpisodes | None = None,
        metrics: GatewayMetrics | None = None,
        trainer_in_process: bool = False,
        shard_options: dict[str, object] | None = None,
    ) -> None:
        self.turns = turns
        # The embedded trainer shares this process: after a crash it republishes its
        # checkpoint, so a version it handed over in process is not lost for good.
        self.trainer_in_process = trainer_in_process
        self.sessions = turns.sessions
        self.runs = RunStore(turns.sessions)
        self.live_episodes = live or LiveEpisodes()
        self.metrics = metrics
        self.runtimes = runtimes
        self.settings = settings
        self.executors: dict[uuid.UUID, RunExecutor | ShardedRun] = {}
        # What a sharded run's shards load besides the run (benchmarks, tests):
        # `runtime_factory` and `preload`, see `ShardedRun`.
        self.shard_options = dict(shard_options or {})
        self._streams: dict[uuid.UUID, DbTrajectoryStream] = {}
        self._restarting: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._env_servers: dict[uuid.UUID, EnvServers] = {}  # placed as Ray actors
        self._mix_changes: dict[uuid.UUID, asyncio.Lock] = {}  # one change at a time per run

    async def create(self, config: RunConfig, *, start: bool = True) -> uuid.UUID:
        """Store a new run (linked to the registered envs it plays) and, with `start`,
        start it. An env entry that resolves to nothing is refused before anything is
        stored."""
        self._check_shards(config)
        sources = await resolve_env_sources(self.sessions, config.envs)
        run_id = await self.runs.create(
            config.name,
            config.model_dump(mode="json"),
            (s.environment_id for s in sources if s.environment_id is not None),
        )
        if start:
            await self.start(run_id, config, sources=sources)
        return run_id

    async def start(
        self,
        run_id: uuid.UUID,
        config: RunConfig,
        *,
        paused: bool = False,
        sources: list[EnvSource] | None = None,
    ) -> None:
        """Build the run's engine and start admitting episodes."""
        if run_id in self.executors:
            raise Conflict(f"run {run_id} is already live")
        if config.rollout.controllers > 1:
            await self._start_sharded(run_id, config, paused=paused, sources=sources)
            return
        try:
            if sources is None:
                sources = await resolve_env_sources(self.sessions, config.envs)
            agent = self._agent(config)
            runtime = await asyncio.to_thread(build_runtime, config)  # loading weights blocks
            try:
                await load_newest_weights(
                    self.runs, run_id, runtime, trainer_in_process=self.trainer_in_process
                )
                if config.placement.ray and config.placement.env_servers:
                    from agentflow.placement.env_servers import place_env_servers

                    servers = await place_env_servers(config, sources)
                    self._env_servers[run_id] = servers
                    sources = servers.sources(sources)
            except BaseException:
                with contextlib.suppress(Exception):
                    await runtime.engine.close()
                raise
        except Exception as exc:
            # The run is stored: record why it never started rather than leave it pending.
            await self._mark_failed(run_id, f"could not start: {type(exc).__name__}: {exc}")
            raise
        self.runtimes.register(run_id, runtime)
        executor = RunExecutor(
            run_id,
            config,
            turns=self.turns,
            runs=self.runs,
            runtime=runtime,
            sources=sources,
            agent=agent,
            gateway_url=self.settings.public_url or "",
            secret_key=self.settings.secret_key,
            on_finish=self._finished,
        )
        self.executors[run_id] = executor
        self._streams[run_id] = executor.trajectory_stream()
        await executor.start(paused=paused)

    def _check_shards(self, config: RunConfig) -> None:
        bind = self.sessions.kw.get("bind")
        if config.rollout.controllers > 1 and bind is not None and bind.dialect.name == "sqlite":
            raise InvalidInput(
                f"{config.rollout.controllers} controller shards write to one database at "
                "once; SQLite has one writer at a time: serve from PostgreSQL",
                field=("rollout", "controllers"),
            )

    async def _start_sharded(
        self,
        run_id: uuid.UUID,
        config: RunConfig,
        *,
        paused: bool,
        sources: list[EnvSource] | None,
    ) -> None:
        """The run's episodes played by `rollout.controllers` shard processes; this process
        keeps its gate, admission, status and stream (`agentflow.rollout.shards`)."""
        try:
            self._check_shards(config)
            if sources is None:
                sources = await resolve_env_sources(self.sessions, config.envs)
            run = ShardedRun(
                run_id,
                config,
                turns=self.turns,
                runs=self.runs,
                sources=sources,
                settings=self.settings,
                on_finish=self._finished,
                worker_options=self.shard_options,
            )
            self.executors[run_id] = run
            self._streams[run_id] = run.trajectory_stream()
            await run.start(paused=paused)
        except Exception as exc:
            self.executors.pop(run_id, None)
            self._streams.pop(run_id, None)
            await self._mark_failed(run_id, f"could not start: {type(exc).__name__}: {exc}")
            raise

    async def change_envs(
        self, run_id: uuid.UUID, change: EnvMixChange, *, changed_by: str
    ) -> EnvRevision:
        """Change a run's env mix: checked whole (as a new run's config would be), stored
        as its next revision, then in effect for the groups admitted next. Changes to one
        run apply one at a time, in the order they come; one made against a revision the
        mix has moved past is refused (`EnvMixChange.revision`), as is any change to a run
        that has ended."""
        lock = self._mix_changes.setdefault(run_id, asyncio.Lock())
        async with lock:
            restart = self._restarting.get(run_id)
            if restart is not None:
                await asyncio.shield(restart)
            stored = await self.runs.get(run_id)
            if stored.status in ENDED_RUN_STATUSES:
                raise Conflict(f"run {run_id} is {stored.status}: its env mix cannot change")
            if run_id in self._env_servers:
                raise Conflict(
                    f"run {run_id}'s envs are served by env-server actors, placed when it "
                    "started: stop it and start a run with the new mix"
                )
            current = RunConfig.model_validate(stored.config)
            entries = revise_mix(current.envs, change)
            try:
                config = with_envs(current, entries)
                sources = await resolve_env_sources(self.sessions, config.envs)
                executor = self.executors.get(run_id)
                plan = None if executor is None else executor.prepare_envs(config, sources)
            except InvalidInput as exc:
                raise InvalidInput(exc.message, field=blame(change, entries, exc.field)) from None
            revision = await self.runs.revise_envs(
                run_id,
                # A stale revision is refused there, where the mix is stored.
                seen=stored.env_revision if change.revision is None else change.revision,
                config=config.model_dump(mode="json"),
                weight_version=stored.weight_version
                if executor is None
                else executor.weight_version,
                changed_by=changed_by,
                environment_ids=(s.environment_id for s in sources if s.environment_id),
            )
            if executor is not None and plan is not None:  # live here: in effect now
                await executor.apply_envs(config, plan)
            log.info(
                "run %s: env mix revision %d by %s: %s",
                run_id,
                revision.revision,
                changed_by,
                ", ".join(f"{e.id}={e.weight:g}" for e in config.envs),
            )
            return revision

    async def stream(self, run_id: uuid.UUID) -> DbTrajectoryStream:
        """The run's trajectory stream; a finished run's stored config still serves one."""
        stream = self._streams.get(run_id)
        if stream is not None:
            return stream
        stored = await self.runs.get(run_id)
        config = RunConfig.model_validate(stored.config, context=UNLOADED)  # no plug-in runs
        stream = run_stream(self.turns, run_id, config)
        self._streams[run_id] = stream
        return stream

    async def record_metrics(
        self, run_id: uuid.UUID, version: int, metrics: dict[str, float], step: int | None = None
    ) -> None:
        """Attach a trainer step's metrics to the weight version it produced (replacing
        what an older version holds for that step: `Runs.record_metrics`); the latest are
        also `/metrics` gauges."""
        await self.runs.record_metrics(run_id, version, metrics, step)
        if self.metrics is not None:
            self.metrics.record_step(str(run_id), version, metrics)

    async def update_weights(self, run_id: uuid.UUID, update: WeightUpdate) -> int:
        """Switch a live run's engine to new weights (see `RunExecutor.update_weights`)."""
        executor = await self.live(run_id)
        return await executor.update_weights(update)

    async def weight_group_ranks(self, run_id: uuid.UUID) -> int:
        """How many ranks the run's engine brings to a trainer's weight group."""
        return await (await self._receiver(run_id)).weight_group_ranks()

    async def join_weight_group(self, run_id: uuid.UUID, group: WeightGroup) -> None:
        """Have the run's engine join a trainer's weight group (answers once it formed)."""
        await (await self._receiver(run_id)).join_weight_group(group)

    async def _receiver(self, run_id: uuid.UUID) -> BroadcastReceiver:
        executor = await self.live(run_id)
        if isinstance(executor, ShardedRun):
            raise Conflict(
                f"run {run_id} is played by controller shards, which load weights from disk"
            )
        engine = executor.runtime.engine
        if not isinstance(engine, BroadcastReceiver):
            raise Conflict(
                f"run {run_id}'s engine ({type(engine).__name__}) does not take broadcast "
                "weights: publish with disk sync"
            )
        return engine

    def _agent(self, config: RunConfig) -> Agent:
        if config.agent.type == "whitebox":
            return whitebox_agent(config, metrics=self.metrics)
        agent = config.agent
        if agent.type in ("http", "container") and not self.settings.public_url:
            raise Conflict(
                f"a {agent.type!r} agent calls this gateway back, but it is not served over "
                "HTTP here (no public URL): run it with `agentflow serve`, or set "
                "AGENTFLOW_PUBLIC_URL"
            )
        if agent.type == "http":
            assert agent.url is not None  # the config validator requires it
            return HttpAgent(
                str(agent.url), self.live_episodes, deadline_s=agent.deadline_s, reward=agent.reward
            )
        if agent.type == "python":
            return python_agent(config)
        return ContainerAgent(
            agent.command, self.live_episodes, deadline_s=agent.deadline_s, reward=agent.reward
        )

    async def live(self, run_id: uuid.UUID) -> RunExecutor | ShardedRun:
        """The run's executor, waiting for it if the run is restarting after a crash."""
        restart = self._restarting.get(run_id)
        if restart is not None:
            await asyncio.shield(restart)
        executor = self.executors.get(run_id)
        if executor is None:
            raise Conflict(f"run {run_id} is not live in this gateway")
        return executor

    async def _finished(self, executor: RunExecutor | ShardedRun) -> None:
        self.executors.pop(executor.run_id, None)
        runtime = self.runtimes.remove(executor.run_id)
        if runtime is not None:
            with contextlib.suppress(Exception):
                await runtime.engine.close()
        await self._close_env_servers(executor.run_id)

    async def _close_env_servers(self, run_id: uuid.UUID) -> None:
        servers = self._env_servers.pop(run_id, None)
        if servers is not None:
            with contextlib.suppress(Exception):
                await servers.close()

    async def recover(self) -> None:
        """After a crash: no episode stays live; runs that were live start again."""
        aborted, runs = await self.runs.recover(RESTART_REASON)
        if aborted:
            log.warning("recovery: aborted %d live episodes", aborted)
        for run in runs:
            # In the background: the gateway serves while engines load.
            restart = asyncio.create_task(self._restart(run.id, run.config, run.status == "paused"))
            self._restarting[run.id] = restart
            restart.add_done_callback(self._forget_restart(run.id))

    def _forget_restart(self, run_id: uuid.UUID) -> Callable[[asyncio.Task[None]], None]:
        def forget(_: asyncio.Task[None]) -> None:
            self._restarting.pop(run_id, None)

        return forget

    async def _restart(self, run_id: uuid.UUID, config: dict[str, object], paused: bool) -> None:
        try:
            run_config = RunConfig.model_validate(config)
        except ValidationError as exc:
            await self._mark_failed(run_id, f"its stored config is no longer valid: {exc}")
            return
        try:
            await self.start(run_id, run_config, paused=paused)
        except Exception:  # noqa: BLE001 - that run fails (recorded), the gateway serves on
            log.exception("recovery: run %s could not restart", run_id)

    async def _mark_failed(self, run_id: uuid.UUID, error: str) -> None:
        await self.runs.fail(run_id, error)

    async def shutdown(self) -> None:
        """Stop admitting and abort live episodes; runs keep their status for a restart."""
        restarts = list(self._restarting.values())
        for restart in restarts:
            restart.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        for executor in list(self.executors.values()):
            await executor.halt("the gateway shut down")
        for run_id, runtime in self.runtimes.items():
            self.runtimes.remove(run_id)
            with contextlib.suppress(Exception):
                await runtime.engine.close()
        for run_id in list(self._env_servers):
            await self._close_env_servers(run_id)
