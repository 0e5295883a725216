"""`RunExecutor`: runs a run's episodes under its concurrency caps.

The simple precursor of the staleness-bounded scheduler: tasks are drawn from the env mix
(weighted, seeded), each task is played `group_size` times (one group), and at most
`rollout.max_concurrency` episodes are live at once, and at most each env's own cap.
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
from typing import Literal

from sqlalchemy import update

from agentflow.agents.base import Agent, Budget, EpisodeHandle, EpisodeOutcome
from agentflow.agents.keys import episode_key
from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.models import Run
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict
from agentflow.rollout.envs import EnvSource
from agentflow.run_config import RunConfig

log = logging.getLogger(__name__)

RunState = Literal["running", "paused", "stopped", "finished", "failed"]


@dataclass
class RunCounters:
    started: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    last_error: str | None = None


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
        self._slots = asyncio.Semaphore(config.rollout.max_concurrency)
        self._env_slots = [asyncio.Semaphore(s.max_concurrency) for s in sources]
        self._live: set[asyncio.Task[None]] = set()  # one per episode, never cancelled
        self._agents: set[asyncio.Task[EpisodeOutcome]] = set()  # cancelled on a stop
        self._main: asyncio.Task[None] | None = None
        self._stop_reason: str | None = None
        self._ending = False

    # ---- control --------------------------------------------------------------------

    async def start(self, *, paused: bool = False) -> None:
        if paused:
            await self.pause()
        else:
            await self._set_status("running")
        self._main = asyncio.create_task(self._admit_loop(), name=f"run-{self.run_id}")

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
                source_index = self._pick_source()
                task: dict[str, object] = {"seed": self._rng.randrange(2**31)}
                group_id = uuid.uuid4().hex
                for _ in range(rollout.group_size):
                    if rollout.max_episodes and self.counters.started >= rollout.max_episodes:
                        break
                    await self._unpaused.wait()
                    await self._slots.acquire()
                    await self._env_slots[source_index].acquire()
                    self.counters.started += 1
                    episode = asyncio.create_task(self._play(source_index, task, group_id))
                    self._live.add(episode)
                    episode.add_done_callback(self._live.discard)
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

    async def _play(self, source_index: int, task: dict[str, object], group_id: str) -> None:
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
            await self._complete(episode_id, outcome)

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

    async def _complete(self, episode_id: uuid.UUID, outcome: EpisodeOutcome) -> None:
        counters = self.counters
        counters.by_status[outcome.status] = counters.by_status.get(outcome.status, 0) + 1
        if outcome.status == "failed":
            counters.consecutive_failures += 1
            counters.last_error = outcome.error
        elif outcome.status in ("completed", "truncated"):
            counters.consecutive_failures = 0
        try:
            await self.turns.complete_episode(
                episode_id,
                outcome.status,
                outcome.reward,
                leaf_turn_ids=outcome.leaf_turn_ids,
                error=outcome.error,
            )
        except Conflict:
            pass  # finished elsewhere (a black-box agent's callback): its record stands
        except Exception:  # noqa: BLE001 - logged; recovery aborts it on the next start
            log.exception("could not complete episode %s", episode_id)
        limit = self.config.rollout.max_consecutive_failures
        if counters.consecutive_failures >= limit and self.state in ("running", "paused"):
            reason = f"{limit} episodes failed in a row; last: {counters.last_error}"
            asyncio.get_running_loop().create_task(self._end("failed", reason))

    # ---- ending ---------------------------------------------------------------------

    async def _end(self, state: RunState, reason: str | None, *, record: bool = True) -> None:
        if self.state in ("stopped", "finished", "failed") or self._ending:
            return
        self._ending = True
        self.state = state
        self._stop_reason = reason
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
