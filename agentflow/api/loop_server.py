"""`LoopServer`: serve an ASGI app inside an event loop that does other work."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

from fastapi import FastAPI


class LoopServer:
    """An app served on a port from within a running event loop, for as long as its
    `async with` lasts (the dashboard beside a training run, a gateway or an env server
    inside a process that does other work). It leaves the process's signals alone:
    Ctrl-C stops that work as it always does, not this server first."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopServer:
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
