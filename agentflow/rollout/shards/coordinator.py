"""`ShardedRun`: one run's episodes played by `rollout.controllers` shard processes.

The gateway keeps what must be one per run: the staleness gate, the env mix and the
task sequence (`LocalAdmission`, as an unsharded run has it), the run's status, its weight
version and counters, and the trajectory stream. Each shard (`python -m
agentflow.rollout.shards.worker`) runs an ordinary `RunExecutor` with its share of the
live episodes and engines, asks the coordinator for every group it plays
(`RemoteAdmission`), writes its turns and episodes to the database itself, and reports
each group settled and each episode recorded. So a group is played within one shard, and
the gate counts every group of every shard, refunds included.

Control reaches every shard: a pause stops admission here and in each shard; a weight
update is switched on every shard's engines (from disk) before the version is recorded
and the gate opens; a stop or halt aborts every shard's live episodes.

A shard that dies is recovered as a gateway restart recovers a run: the live episodes of
the groups it held are aborted with the reason, groups that made no trajectory are
refunded to the gate, and a new shard takes its place (loading the newest weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentflow.config import Settings
from agentflow.db.runs import IN_PROCESS_URI, RunStore
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Conflict
from agentflow.inference.base import WeightUpdate, next_weight_version
from agentflow.rollout.envs import EnvSource
from agentflow.rollout.executor import (
    GroupTicket,
    LocalAdmission,
    RunCounters,
    RunState,
    run_stream,
)
from agentflow.rollout.gate import StalenessGate
from agentflow.rollout.lanes import EnvLanes, LanePlan
from agentflow.rollout.shards.wire import Message, Peer, RemoteError, ShardLost
from agentflow.rollout.stream import DbTrajectoryStream
from agentflow.run_config import RunConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "agentflow.rollout.shards.worker"
MAX_REPLACEMENTS = 16  # shards started again after dying, over the run; then it fails
STOP_GRACE_S = 60.0  # a stopping shard records its aborted episodes within this


@dataclass
class _Shard:
    index: int
    generation: int  # 0 for the first process at this index, +1 per replacement
    process: asyncio.subprocess.Process
    peer: Peer
    held: dict[str, GroupTicket] = field(default_factory=dict)  # admitted, not settled
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None  # why it could not start
    leaving: bool = False  # told to stop, or done: its exit is expected
    dead: bool = False
    serving: asyncio.Task[None] | None = None


class ShardedRun:
    """The run's coordinator in the gateway; presents what `RunExecutor` does to
    `RunManager`, the API and the embedded trainer."""

    def __init__(
        self,
        run_id: uuid.UUID,
        config: RunConfig,
        *,
        turns: TurnTree,
        runs: RunStore,
        sources: list[EnvSource],
        settings: Settings,
        on_finish: Callable[[ShardedRun], Awaitable[None]] | None = None,
        worker_options: dict[str, Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.turns = turns
        self.runs = runs
        self.settings = settings
        self.on_finish = on_finish
        # For benchmarks and tests: `runtime_factory` ("pkg.mod:fn", fn(config, index,
        # count, **runtime_options) -> PolicyRuntime, built in a thread), `runtime_options`
        # and `preload` (modules imported first) in each shard.
        self.worker_options = dict(worker_options or {})
        self.count = config.rollout.controllers
        self.state: RunState = "running"
        self.counters = RunCounters()
        self.weight_version = 0
        self.gate: StalenessGate | None = None
        if config.rollout.wait_for_trainer:
            self.gate = StalenessGate(
                max_staleness=config.rollout.max_staleness,
                batch_episodes=config.trainer.batch_episodes,
                group_size=config.samples_per_group(),
            )
        # The shards play the lanes; here they key the mix and check its reward functions.
        self.lanes = EnvLanes(config.envs, sources)
        self.admission = LocalAdmission(config, self.lanes.mix, self.gate)
        self.assignments: dict[str, int] = {}  # group id -> the shard index that played it
        self.replacements = 0
        self.shards: list[_Shard | None] = [None] * self.count
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._all_started = asyncio.Event()  # no group before every shard can play
        self._control = asyncio.Lock()  # updates, replacements and stops, one at a time
        self._watchers: set[asyncio.Task[None]] = set()
        self._ended = asyncio.Event()
        self._ending = False
        self._exhausted = False

    # ---- control --------------------------------------------------------------------

    async def start(self, *, paused: bool = False) -> None:
        point = await self.runs.restore_point(self.run_id)
        self.weight_version = point.version
        if self.gate is not None:
            self.gate.resume_from(point.version, point.groups_admitted, point.groups_taken)
        if paused:
            self._unpaused.clear()
            self.state = "paused"
        await self.runs.set_status(self.run_id, self.state)
        try:
            async with self._control:
                await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        except BaseException:
            await self._kill_all()
            raise
        self._all_started.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        """Switch every shard's engines to the weights at `update.path`, then record the
        version and open the gate. A shard that dies meanwhile is left to its
        replacement, which loads the recorded version when it starts."""
        self._require_live()
        if update.path is None:
            raise Conflict(
                f"run {self.run_id} is played by {self.count} controller shards, which load "
                "weights from a directory: publish with weights.sync = 'disk'"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._control:
            version = next_weight_version(self.weight_version, update)
            await self._tell_all("update", path=update.path, version=version)
            seconds = loop.time() - started
            uri = update.uri or IN_PROCESS_URI
            await self.runs.record_version(self.run_id, version, uri, {"switch_seconds": seconds})
            self.weight_version = version
        self.counters.weight_updates += 1
        self.counters.update_seconds += seconds
        if self.gate is not None:
            await self.gate.advance(version)
        return version

    def prepare_envs(self, config: RunConfig, sources: list[EnvSource]) -> LanePlan:
        self._require_live()
        return self.lanes.prepare(config.envs, sources)

    async def apply_envs(self, config: RunConfig, plan: LanePlan) -> None:
        """Every shard switches to `config`'s mix before the next group is admitted from
        it; a shard started later (a replacement) starts from it."""
        async with self._control:
            self.config = config
            await self._tell_all("envs", config=config.model_dump(mode="json"))
            self.lanes.apply(plan)
            self.admission.set_mix(self.lanes.mix)

    def trajectory_stream(self) -> DbTrajectoryStream:
        return run_stream(self.turns, self.run_id, self.config, gate=self.gate)

    async def pause(self) -> None:
        self._require_live()
        self._unpaused.clear()
        self.state = "paused"
        await self.runs.set_status(self.run_id, "paused")
        await self._tell_all("pause")

    async def resume(self) -> None:
        self._require_live()
        self._unpaused.set()
        self.state = "running"
        await self.runs.set_status(self.run_id, "running")
        await self._tell_all("resume")

    async def stop(self, reason: str = "run stopped") -> None:
        if self.state in ("stopped", "finished", "failed"):
            return
        await self._end("stopped", reason)

    async def halt(self, reason: str) -> None:
        await self._end(self.state, reason, record=False)

    async def wait(self) -> None:
        await self._ended.wait()

    async def shard_writes(self) -> dict[int, Message]:
        """Each live shard's group commits, by its process id: the writes queued by kind
        (`TurnTree.queued_writes`) and the wait histograms so far (`write_waits`). A
        shard that dies meanwhile is left out."""

        async def ask(shard: _Shard) -> tuple[int, Message | None]:
            try:
                return shard.process.pid, await shard.peer.call("writes")
            except (ShardLost, RemoteError):  # gone, or not playing yet
                return shard.process.pid, None

        answers = await asyncio.gather(*(ask(s) for s in self._playing()))
        return {pid: answer for pid, answer in answers if answer is not None}

    def shard_pids(self) -> list[int]:
        return [s.process.pid for s in self.shards if s is not None and not s.dead]

    def _require_live(self) -> None:
        if self.state not in ("running", "paused"):
            raise Conflict(f"run {self.run_id} is {self.state}")

    def _playing(self) -> list[_Shard]:
        """The shards alive and not on their way out."""
        return [s for s in self.shards if s is not None and not (s.dead or s.leaving)]

    async def _tell_all(self, op: str, **fields: Any) -> None:
        async def tell(shard: _Shard) -> None:
            with contextlib.suppress(ShardLost):
                await shard.peer.call(op, **fields)

        await asyncio.gather(*(tell(s) for s in self._playing()))

    # ---- shards ---------------------------------------------------------------------

    async def _spawn(self, index: int, generation: int = 0) -> None:
        """Start shard `index` and wait until it plays (its engine built, the newest
        weights loaded). Called under `_control`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                WORKER_MODULE,
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        shard: _Shard | None = None

        async def handle(op: str, message: Message) -> Message | None:
            assert shard is not None
            return await self._handle(shard, op, message)

        peer = await Peer.over(ours, handle)
        shard = _Shard(index, generation, process, peer)
        self.shards[index] = shard
        shard.serving = asyncio.create_task(peer.serve())
        peer.tell(
            "spec",
            run_id=str(self.run_id),
            index=index,
            count=self.count,
            generation=generation,
            paused=not self._unpaused.is_set(),
            config=self.config.model_dump(mode="json"),
            settings=self.settings.model_dump(mode="json"),
            **self.worker_options,
        )
        watcher = asyncio.create_task(self._watch(shard))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        ready = asyncio.create_task(shard.ready.wait())
        gone = asyncio.create_task(process.wait())
        try:
            await asyncio.wait({ready, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            gone.cancel()
        if shard.failed is not None or not shard.ready.is_set():
            why = shard.failed or f"its process exited with {process.returncode}"
            raise Conflict(f"controller shard {index} of run {self.run_id} did not start: {why}")
        log.info("run %s: controller shard %d (pid %d) plays", self.run_id, index, process.pid)

    async def _handle(self, shard: _Shard, op: str, message: Message) -> Message | None:
        if op == "admit":
            return await self._admit(shard, int(message.get("want", 1)))
        if op == "settled":
            ticket = shard.held.pop(str(message["group_id"]), None)
            if ticket is not None:
                await self.admission.group_settled(ticket, int(message["trajectories"]))
            return None
        if op == "episode":
            self._count_episode(str(message["status"]), message.get("error"))
            return None
        if op == "ready":
            shard.ready.set()
            return None
        if op == "failed":
            shard.failed = str(message.get("error"))
            return None
        if op == "done":
            shard.leaving = True
            return None
        raise ValueError(f"unknown message {op!r}")

    async def _admit(self, shard: _Shard, want: int) -> Message:
        """A shard's next groups, through the run's own admission: the first when the gate
        lets it start, then up to `want` in all as long as the gate is open now. None (an
        empty list) once the run has admitted its last group."""
        await self._all_started.wait()
        await self._unpaused.wait()
        tickets: list[GroupTicket] = []
        while len(tickets) < max(1, want):
            if tickets and not (
                self._unpaused.is_set() and (self.gate is None or self.gate.open())
            ):
                break
            ticket = await self.admission.next_group()
            if ticket is None:
                self._exhausted = True
                break
            tickets.append(ticket)
        if shard.dead or self._ending:
            # They never reached the shard: no episode of them exists.
            for ticket in tickets:
                await self.admission.group_settled(ticket, 0)
            return {"tickets": []}
        for ticket in tickets:
            shard.held[ticket.group_id] = ticket
            self.assignments[ticket.group_id] = shard.index
            self.counters.groups += 1
            self.counters.started += ticket.episodes
        return {
            "tickets": [
                {
                    "group_id": t.group_id,
                    "env": t.env,
                    "task": t.task,
                    "episodes": t.episodes,
                }
                for t in tickets
            ]
        }

    def _count_episode(self, status: str, error: object) -> None:
        counters = self.counters
        counters.count_episode(status, None if error is None else str(error))
        limit = self.config.rollout.max_consecutive_failures
        if counters.consecutive_failures >= limit and self.state in ("running", "paused"):
            reason = f"{limit} episodes failed in a row; last: {counters.last_error}"
            asyncio.get_running_loop().create_task(self._end("failed", reason))

    async def _watch(self, shard: _Shard) -> None:
        """Until the shard's process exits: then a finished run ends, a dead shard is
        recovered and replaced."""
        returncode = await shard.process.wait()
        if shard.serving is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(shard.serving), 5)  # its last messages
        shard.peer.close()
        shard.dead = True
        if not shard.ready.is_set():
            return  # `_spawn` reports it
        if shard.leaving and returncode == 0:
            if self._exhausted and not self._ending and self._all_done():
                await self._end("finished", None)
            return
        if self._ending:
            return  # a stop that had to kill it recovers its groups
        log.warning(
            "run %s: controller shard %d (pid %d) died (exit %s); recovering its %d groups",
            self.run_id,
            shard.index,
            shard.process.pid,
            returncode,
            len(shard.held),
        )
        await self._recover(shard, f"controller shard {shard.index} died (exit {returncode})")
        if self._ending or self.state not in ("running", "paused"):
            return
        if self.replacements >= MAX_REPLACEMENTS:
            await self._end(
                "failed", f"{MAX_REPLACEMENTS} controller shards replaced; the last died"
            )
            return
        self.replacements += 1
        try:
            async with self._control:
                if not self._ending:
                    await self._spawn(shard.index, shard.generation + 1)
        except Exception as exc:  # noqa: BLE001 - the run fails with the reason recorded
            log.exception("run %s: could not replace controller shard %d", self.run_id, shard.index)
            await self._end("failed", f"{type(exc).__name__}: {exc}")

    def _all_done(self) -> bool:
        return all(s is None or (s.dead and s.leaving) for s in self.shards)

    async def _recover(self, shard: _Shard, reason: str) -> None:
        """The shard's groups: live episodes aborted, groups without a trajectory refunded."""
        held = list(shard.held.values())
        shard.held.clear()
        reason = f"{reason} while the episode was live"
        aborted, made = await self.runs.abort_groups(
            self.run_id, (t.group_id for t in held), reason
        )
        if aborted:
            self.counters.by_status["aborted"] = self.counters.by_status.get("aborted", 0) + aborted
        for ticket in held:
            await self.admission.group_settled(ticket, made.get(ticket.group_id, 0))

    # ---- ending ---------------------------------------------------------------------

    async def _end(self, state: RunState, reason: str | None, *, record: bool = True) -> None:
        if self._ending or self._ended.is_set():
            return
        self._ending = True
        finished = state == "finished"
        self.state = state
        if not finished:
            op = "stop" if record else "halt"
            async with self._control:
                await self._stop_shards(op, reason or "run stopped")
        if record:
            await self.runs.set_status(
                self.run_id, state, error=reason if state == "failed" else None
            )
        self._ended.set()
        if self.on_finish is not None:
            await self.on_finish(self)

    async def _stop_shards(self, op: str, reason: str) -> None:
        """Each shard aborts its live episodes (recorded with `reason`) and exits; one that
        does not within `STOP_GRACE_S` is killed and its groups recovered here."""
        live = [s for s in self.shards if s is not None and not s.dead]

        async def stop(shard: _Shard) -> None:
            shard.leaving = True
            with contextlib.suppress(ShardLost, RemoteError, asyncio.TimeoutError):
                await asyncio.wait_for(shard.peer.call(op, reason=reason), STOP_GRACE_S)
            try:
                await asyncio.wait_for(shard.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.warning(
                    "run %s: controller shard %d did not exit; killed", self.run_id, shard.index
                )
                with contextlib.suppress(ProcessLookupError):
                    shard.process.kill()
                await shard.process.wait()
            if shard.held:
                await self._recover(shard, f"the run ended ({reason})")

        await asyncio.gather(*(stop(s) for s in live))

    async def _kill_all(self) -> None:
        self._ending = True
        for shard in self.shards:
            if shard is not None and shard.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shard.process.pid, signal.SIGKILL)
                await shard.process.wait()
