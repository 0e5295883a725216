"""`RunManager`: the gateway's live runs, their engines, and recovery after a crash."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import ValidationError
from sqlalchemy import select, update

from agentflow.agents.base import Agent
from agentflow.agents.blackbox.container_agent import ContainerAgent
from agentflow.agents.blackbox.http_agent import HttpAgent
from agentflow.agents.blackbox.live import LiveEpisodes
from agentflow.agents.runtime import PolicyRuntime, RuntimeRegistry
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.config import Settings
from agentflow.db.models import Episode, Run, WeightVersion
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict, NotFound
from agentflow.inference.base import PauseMode, SamplingParams, WeightUpdate
from agentflow.metrics import GatewayMetrics
from agentflow.rollout.envs import resolve_env_sources
from agentflow.rollout.executor import RunExecutor
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import RunConfig
from agentflow.types import OPEN_EPISODE_STATUSES

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
    ) -> None:
        self.turns = turns
        self.sessions = turns.sessions
        self.live_episodes = live or LiveEpisodes()
        self.metrics = metrics
        self.runtimes = runtimes
        self.settings = settings
        self.executors: dict[uuid.UUID, RunExecutor] = {}
        self._streams: dict[uuid.UUID, DbTrajectoryStream] = {}
        self._restarting: dict[uuid.UUID, asyncio.Task[None]] = {}

    async def start(self, run_id: uuid.UUID, config: RunConfig, *, paused: bool = False) -> None:
        """Build the run's engine and start admitting episodes."""
        if run_id in self.executors:
            raise Conflict(f"run {run_id} is already live")
        try:
            sources = await resolve_env_sources(self.sessions, config.envs)
            runtime = await asyncio.to_thread(_build_runtime, config)  # loading weights blocks
        except Exception as exc:
            # The run is stored: record why it never started rather than leave it pending.
            await self._mark_failed(run_id, f"could not start: {type(exc).__name__}: {exc}")
            raise
        self.runtimes.register(run_id, runtime)
        executor = RunExecutor(
            run_id,
            config,
            turns=self.turns,
            runtime=runtime,
            sources=sources,
            agent=self._agent(config),
            gateway_url=self.settings.public_url,
            secret_key=self.settings.secret_key,
            on_finish=self._finished,
        )
        self.executors[run_id] = executor
        self._streams[run_id] = executor.trajectory_stream()
        await executor.start(paused=paused)

    def _stream_for(self, run_id: uuid.UUID, config: RunConfig) -> DbTrajectoryStream:
        rollout = config.rollout
        return DbTrajectoryStream(
            self.turns,
            run_id,
            group_size=rollout.group_size,
            max_staleness=rollout.max_staleness if rollout.wait_for_trainer else None,
            max_reuse=rollout.max_reuse,
            stale_policy=rollout.stale_policy,
            lease_s=rollout.lease_s,
        )

    async def stream(self, run_id: uuid.UUID) -> DbTrajectoryStream:
        """The run's trajectory stream; a finished run's stored config still serves one."""
        stream = self._streams.get(run_id)
        if stream is not None:
            return stream
        async with self.sessions() as session:
            stored = await session.scalar(select(Run.config).where(Run.id == run_id))
        if stored is None:
            raise NotFound(f"run {run_id} not found")
        stream = self._stream_for(run_id, RunConfig.model_validate(stored))
        self._streams[run_id] = stream
        return stream

    async def record_metrics(
        self, run_id: uuid.UUID, version: int, metrics: dict[str, float]
    ) -> None:
        """Attach a trainer step's metrics to the weight version it produced."""
        async with self.sessions.begin() as session:
            await session.execute(
                update(WeightVersion)
                .where(WeightVersion.run_id == run_id)
                .where(WeightVersion.version == version)
                .values(metrics=metrics)
            )

    async def update_weights(self, run_id: uuid.UUID, update: WeightUpdate) -> int:
        """Switch a live run's engine to new weights (see `RunExecutor.update_weights`)."""
        executor = await self.live(run_id)
        return await executor.update_weights(update)

    def _agent(self, config: RunConfig) -> Agent:
        if config.agent.type == "whitebox":
            return WhiteBoxAgent(
                park_after_s=config.rollout.park_after_s,
                system_prompt=config.agent.system_prompt,
                metrics=self.metrics,
            )
        agent = config.agent
        if agent.type == "http":
            assert agent.url is not None  # the config validator requires it
            return HttpAgent(
                str(agent.url), self.live_episodes, deadline_s=agent.deadline_s, reward=agent.reward
            )
        return ContainerAgent(
            agent.command, self.live_episodes, deadline_s=agent.deadline_s, reward=agent.reward
        )

    async def live(self, run_id: uuid.UUID) -> RunExecutor:
        """The run's executor, waiting for it if the run is restarting after a crash."""
        restart = self._restarting.get(run_id)
        if restart is not None:
            await asyncio.shield(restart)
        executor = self.executors.get(run_id)
        if executor is None:
            raise Conflict(f"run {run_id} is not live in this gateway")
        return executor

    async def _finished(self, executor: RunExecutor) -> None:
        self.executors.pop(executor.run_id, None)
        runtime = self.runtimes.remove(executor.run_id)
        if runtime is not None:
            with contextlib.suppress(Exception):
                await runtime.engine.close()

    async def recover(self) -> None:
        """After a crash: no episode stays live; runs that were live start again."""
        now = _now()
        async with self.sessions.begin() as session:
            result = await session.execute(
                update(Episode)
                .where(Episode.status.in_(OPEN_EPISODE_STATUSES))
                .values(status="aborted", error=RESTART_REASON, finished_at=now)
            )
            aborted = getattr(result, "rowcount", 0)
            runs = (
                await session.execute(
                    select(Run.id, Run.config, Run.status).where(
                        Run.status.in_(("running", "paused"))
                    )
                )
            ).all()
        if aborted:
            log.warning("recovery: aborted %d live episodes", aborted)
        for run_id, config, status in runs:
            # In the background: the gateway serves while engines load.
            restart = asyncio.create_task(self._restart(run_id, config, status == "paused"))
            self._restarting[run_id] = restart
            restart.add_done_callback(self._forget_restart(run_id))

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
        async with self.sessions.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(status="failed", error=error, updated_at=_now())
            )

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


def _build_runtime(config: RunConfig) -> PolicyRuntime:
    from agentflow.inference.factory import build_engine, build_template

    template = build_template(config)
    engine, max_context = build_engine(config)
    sampling = SamplingParams(
        temperature=config.agent.temperature,
        max_new_tokens=config.agent.max_new_tokens,
        stop_token_ids=template.stop_ids,
    )
    return PolicyRuntime(
        engine,
        template,
        config.name,
        sampling,
        max_context,
        partial_rollout=config.rollout.partial_rollout,
        interrupt=PauseMode(config.rollout.interrupt),
    )


def _now() -> datetime:
    return datetime.now(UTC)
