"""A real gateway on a loopback port (uvicorn in a thread) with a tiny `LocalEngine` run.

Everything the gateway owns (the engine, the turn tree, live episodes) lives on the
server thread's event loop; tests run coroutines there with `Gateway.call`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import uvicorn

from agentflow.agents.blackbox.live import LiveEpisodes
from agentflow.agents.keys import episode_key
from agentflow.agents.runtime import PolicyRuntime
from agentflow.api.app import create_app
from agentflow.api.routes.chat import turn_tree
from agentflow.config import Settings
from agentflow.db.models import Run
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit
from agentflow.tokenization.chat import ByteChatTemplate
from tests.support.engine import RecordingEngine

TINY = ModelInit(layers=2, hidden=64, heads=2, max_context=4096)
T = TypeVar("T")


class Gateway:
    def __init__(self, database_url: str) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = Settings(database_url=database_url, public_url=self.url)
        self.app = create_app(self.settings)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", lifespan="on", ws="none")
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self._socket]))

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.loop.close()
        self._socket.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def live(self) -> LiveEpisodes:
        live: LiveEpisodes = self.app.state.live_episodes
        return live

    @property
    def turns(self) -> TurnTree:
        return turn_tree(self.app)  # the gateway's own, so writes queue with its writers

    def key(self, episode_id: uuid.UUID) -> str:
        return episode_key(episode_id, self.settings.secret_key)

    async def _new_run(self) -> uuid.UUID:
        async with self.app.state.sessionmaker() as session:
            run = Run(name="blackbox-test", config={}, status="running")
            session.add(run)
            await session.commit()
            return run.id

    def new_run(self, runtime: PolicyRuntime) -> uuid.UUID:
        run_id = self.call(self._new_run())
        self.app.state.runtimes.register(run_id, runtime)
        return run_id

    def new_episode(self, run_id: uuid.UUID, task: dict[str, Any] | None = None) -> uuid.UUID:
        return self.call(self.turns.create_episode(run_id=run_id, task=task or {}))


@pytest.fixture(scope="session")
def gateway(sqlite_database: str) -> Iterator[Gateway]:
    server = Gateway(sqlite_database)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def engine(gateway: Gateway) -> Iterator[RecordingEngine]:
    local = LocalEngine.from_init(TINY, seed=0, max_batch_size=16)
    yield RecordingEngine(local)
    gateway.call(local.close())


@pytest.fixture(scope="session")
def runtime(engine: RecordingEngine) -> PolicyRuntime:
    return PolicyRuntime(
        engine=engine,
        template=ByteChatTemplate(),
        model_name="tiny-policy",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=24),
        max_context=TINY.max_context,
    )


@pytest.fixture(scope="session")
def run_id(gateway: Gateway, runtime: PolicyRuntime) -> uuid.UUID:
    return gateway.new_run(runtime)


@dataclass
class Stack:
    gateway: Gateway
    engine: RecordingEngine
    runtime: PolicyRuntime
    run_id: uuid.UUID


@pytest.fixture(scope="session")
def pg_stack(pg_database: str) -> Iterator[Stack]:
    """The same gateway on PostgreSQL, with its own engine (an engine serves one loop)."""
    server = Gateway(pg_database)
    server.start()
    local = LocalEngine.from_init(TINY, seed=0, max_batch_size=16)
    engine = RecordingEngine(local)
    runtime = PolicyRuntime(
        engine=engine,
        template=ByteChatTemplate(),
        model_name="tiny-policy",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=24),
        max_context=TINY.max_context,
    )
    yield Stack(server, engine, runtime, server.new_run(runtime))
    server.call(local.close())
    server.stop()
