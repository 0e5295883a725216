"""A controller shard's process: `python -m agentflow.rollout.shards.worker FD`, started
by its run's `ShardedRun` with one end of a socket pair as FD.

It reads its spec (the run, its index, the gateway's settings), builds what the gateway
would build for an unsharded run, from its share of the config (`shard_config`), and
plays groups the coordinator admits until the run has admitted its last one, or it is
told to stop or halt. It dies with the gateway: the kernel kills it when the gateway's
process exits (`PR_SET_PDEATHSIG`), and a line that closes halts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.base import Agent, EpisodeOutcome
from agentflow.agents.runtime import PolicyRuntime
from agentflow.config import Settings
from agentflow.db.blobs import blob_store_for
from agentflow.db.runs import RunStore
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import WeightUpdate
from agentflow.rollout.envs import resolve_env_sources
from agentflow.rollout.executor import GroupTicket, RunExecutor
from agentflow.rollout.runtime_setup import (
    build_runtime,
    load_newest_weights,
    python_agent,
    whitebox_agent,
)
from agentflow.rollout.shards.wire import Message, Peer
from agentflow.run_config import RunConfig, shard_config

log = logging.getLogger("agentflow.rollout.shard")

_PR_SET_PDEATHSIG = 1
ADMIT_BATCH = 16  # groups one admission call may bring back


class RemoteAdmission:
    """Groups admitted by the run's coordinator (`GroupAdmission` over the line).

    One call asks for as many groups as the shard could start now (`capacity()`, at least
    one, at most `batch`) and gets at least one (waiting for the gate) and as many more as
    the gate admits at once. When the last group at hand is handed out, the next call is
    already sent, so the round trip (long when this shard's event loop is loaded) overlaps
    the wait for free slots instead of adding to it. At most one call's groups wait here
    beyond the one being started: more would sit idle while another shard waits. Groups
    handed over and not yet started are the coordinator's to refund if this shard ends
    first."""

    def __init__(self, peer: Peer, batch: int = ADMIT_BATCH) -> None:
        self.peer = peer
        self.batch = batch
        self.capacity: Callable[[], int] = lambda: batch
        self._admitted: deque[GroupTicket] = deque()
        self._exhausted = False
        self._asking: asyncio.Task[None] | None = None

    async def next_group(self) -> GroupTicket | None:
        while not self._admitted and not self._exhausted:
            await self._ask()
        ticket = self._admitted.popleft() if self._admitted else None
        if not self._admitted and not self._exhausted and self._asking is None:
            self._asking = asyncio.create_task(self._ask())  # the next, meanwhile
            # A failed call is raised by the next `next_group`'s own call, not from here.
            self._asking.add_done_callback(lambda t: t.cancelled() or t.exception())
        return ticket

    async def _ask(self) -> None:
        """One admission call (joining the one under way, if any)."""
        if self._asking is not None and asyncio.current_task() is not self._asking:
            await asyncio.shield(self._asking)
            return
        try:
            want = max(1, min(self.batch, self.capacity()))
            tickets = (await self.peer.call("admit", want=want))["tickets"]
            self._admitted.extend(
                GroupTicket(
                    group_id=str(t["group_id"]),
                    env=str(t["env"]),
                    task=dict(t["task"]),
                    episodes=int(t["episodes"]),
                )
                for t in tickets
            )
            self._exhausted = not tickets
        finally:
            if asyncio.current_task() is self._asking:
                self._asking = None

    async def group_settled(self, ticket: GroupTicket, trajectories: int) -> None:
        self.peer.tell("settled", group_id=ticket.group_id, trajectories=trajectories)

    def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()


class Shard:
    def __init__(self) -> None:
        self.spec: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.executor: RunExecutor | None = None
        self.peer: Peer | None = None
        self.sessions: async_sessionmaker[AsyncSession] | None = None
        self.place = (0, 1)  # this shard's index, and how many the run has

    async def handle(self, op: str, message: Message) -> Message | None:
        if op == "spec":
            self.spec.set_result(message)
            return None
        executor = self.executor
        if executor is None:
            raise RuntimeError(f"{op} before the shard plays")
        if op == "writes":  # what its group commits hold: the run's queue is the shards' sum
            return {"queued": executor.turns.queued_writes, "waits": executor.turns.write_waits}
        if executor.state not in ("running", "paused"):
            # It has played its last episode (the run admitted its last group, or it was
            # stopped) and is on its way out: nothing left to switch or pause.
            return {"played_out": True}
        if op == "update":
            update = WeightUpdate(path=str(message["path"]), version=int(message["version"]))
            version = await executor.runtime.update_weights(update)
            executor.weight_version = version
            return {"version": version}
        if op == "envs":
            await self._change_envs(executor, RunConfig.model_validate(message["config"]))
            return None
        if op == "pause":
            await executor.pause()
        elif op == "resume":
            await executor.resume()
        elif op == "stop":
            await executor.stop(str(message.get("reason") or "run stopped"))
        elif op == "halt":
            await executor.halt(str(message.get("reason") or "the gateway shut down"))
        else:
            raise ValueError(f"unknown request {op!r}")
        return None

    async def _change_envs(self, executor: RunExecutor, config: RunConfig) -> None:
        """The run's new mix, with this shard's share of each env's cap."""
        assert self.sessions is not None
        share = shard_config(config, *self.place)
        sources = await resolve_env_sources(self.sessions, share.envs)
        await executor.apply_envs(share, executor.prepare_envs(share, sources))

    def report(self, outcome: EpisodeOutcome, made: int) -> None:
        assert self.peer is not None
        self.peer.tell("episode", status=outcome.status, error=outcome.error, trajectories=made)

    async def play(self, peer: Peer, spec: Message) -> None:
        self.peer = peer
        run_id = uuid.UUID(spec["run_id"])
        index, count = int(spec["index"]), int(spec["count"])
        for module in spec.get("preload", ()):
            __import__(module)
        settings = Settings.model_validate(spec["settings"])
        settings.apply_gc_threshold()  # as the gateway's process does
        config = shard_config(RunConfig.model_validate(spec["config"]), index, count)
        db = create_engine(settings.database_url, synchronous_commit=settings.db_synchronous_commit)
        runtime: PolicyRuntime | None = None
        try:
            sessions = session_factory(db)
            self.sessions, self.place = sessions, (index, count)
            turns = TurnTree(sessions, blob_store=blob_store_for(settings))
            runs = RunStore(sessions)
            sources = await resolve_env_sources(sessions, config.envs)
            factory = _runtime_factory(spec)
            options = dict(spec.get("runtime_options") or {})
            built: PolicyRuntime = await asyncio.to_thread(factory, config, index, count, **options)
            runtime = built
            await load_newest_weights(runs, run_id, built, trainer_in_process=False)
            agent: Agent
            if config.agent.type == "python":
                agent = python_agent(config)
            else:
                agent = whitebox_agent(config, stream=index + 1)
            admission = RemoteAdmission(peer)
            self.executor = RunExecutor(
                run_id,
                config,
                turns=turns,
                runs=runs,
                runtime=built,
                sources=sources,
                agent=agent,
                gateway_url="",
                secret_key=settings.secret_key,
                admission=admission,
                on_episode=self.report,
                owns_run=False,
            )
            admission.capacity = self.executor.free_groups
            await self.executor.start(paused=bool(spec.get("paused")))
            peer.tell("ready")
            await self.executor.ended()
            admission.close()
            peer.tell("done")
            await peer.drain()
        finally:
            if runtime is not None:
                with contextlib.suppress(Exception):
                    await runtime.engine.close()
            await db.dispose()


def _runtime_factory(spec: Message) -> Any:
    path = spec.get("runtime_factory")
    if not path:
        return lambda config, index, count: build_runtime(config)
    # Set by the gateway's own code (`RunManager(shard_options=...)`), never by a request.
    module, _, name = str(path).partition(":")
    return getattr(importlib.import_module(module), name)


async def serve(fd: int) -> int:
    shard = Shard()
    peer = await Peer.over(socket.socket(fileno=fd), shard.handle)
    serving = asyncio.create_task(peer.serve())
    waiting: set[asyncio.Future[Any]] = {shard.spec, serving}
    spec_or_gone, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if shard.spec not in spec_or_gone:
        return 1  # the gateway went away before it said what to play
    spec = shard.spec.result()
    prefix = f"shard {spec['index']}: %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=prefix, force=True)
    playing = asyncio.create_task(shard.play(peer, spec))
    done, _ = await asyncio.wait({playing, serving}, return_when=asyncio.FIRST_COMPLETED)
    if playing not in done:  # the line closed: the gateway is gone or gave up on us
        if shard.executor is not None:
            await shard.executor.halt("the run's coordinator is gone")
        playing.cancel()
        with contextlib.suppress(BaseException):
            await playing
        return 1
    try:
        playing.result()
    except Exception as exc:  # noqa: BLE001 - the coordinator gets the reason
        log.exception("the shard failed")
        peer.tell("failed", error=f"{type(exc).__name__}: {exc}")
        await peer.drain()
        return 1
    peer.close()
    return 0


def _die_with_parent() -> None:
    """SIGKILL when the gateway's process ends, however it ends."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # it ended before the line above ran
        sys.exit(1)


def main() -> None:
    _die_with_parent()
    fd = int(sys.argv[1])
    try:  # the event loop the gateway runs on (uvicorn's choice when it is installed)
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        sys.exit(runner.run(serve(fd)))


if __name__ == "__main__":
    main()
