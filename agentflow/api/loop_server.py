"""`LoopServer`: serve an ASGI app inside an event loop that does other work; and
`uvicorn_config`, the uvicorn settings it and `agentflow serve` share."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    import uvicorn

# How long an idle keep-alive connection stays open on the server (uvicorn's
# `timeout_keep_alive`, 5 s unless set). A client's pool reuses an idle connection until
# its own expiry (httpx: 5 s after the previous response). If the server's timeout is no
# longer than that, a request sent just as the server's timer fires is lost: the server
# closes the connection without reading it and logs nothing. The client gets
# httpx.ReadError when the close resets the request, or RemoteProtocolError when the FIN
# arrives first (docs/performance.md, "Keep-alive"). If the server's timeout is longer
# than the clients' expiry, the client always drops an idle connection first. 75 s is
# above httpx's 5 s, aiohttp's 15 s and the 60 s idle timeout load balancers commonly
# use; it is also nginx's default keepalive_timeout.
KEEP_ALIVE_S = 75


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S
    )


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

        self.server = _Server(uvicorn_config(app, host, port, "warning"))
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
