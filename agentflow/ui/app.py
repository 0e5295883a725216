"""The dashboard alone, as an app over a database and runtimes another part of the same
process owns: `agentflow train --ui-port` serves it beside the run it trains.

It reads; it never starts, recovers or stops a run (which the full gateway does at
startup), so it is safe to open on a database another process is training into.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Iterator

from fastapi import FastAPI

import agentflow
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.errors import install_error_handlers
from agentflow.api.routes import health
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.ui import routes
from agentflow.ui.tokens import TokenTexts


def create_dashboard_app(
    settings: Settings, turn_tree: TurnTree, runtimes: RuntimeRegistry
) -> FastAPI:
    app = FastAPI(title="AgentFlow dashboard", version=agentflow.__version__)
    app.state.settings = settings
    app.state.instance_id = uuid.uuid4().hex
    app.state.sessionmaker = turn_tree.sessions
    app.state.turn_tree = turn_tree
    app.state.runtimes = runtimes
    app.state.token_texts = TokenTexts(runtimes)
    install_error_handlers(app)
    app.include_router(health.router)
    for router in routes.routers:
        app.include_router(router)
    return app


class DashboardServer:
    """The dashboard app served on a port from within a running event loop, for as long
    as its `async with` lasts. It leaves the process's signals alone: Ctrl-C stops the
    training as it always does, not this server first."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DashboardServer:
        # Bound here, so a taken port is an OSError now (uvicorn would exit the process).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((self.server.config.host, self.server.config.port))
        except OSError:
            self._socket.close()
            raise
        self._task = asyncio.create_task(self.server.serve(sockets=[self._socket]))
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    async def __aexit__(self, *_: object) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
