"""One desktop as a long-running service: `agentflow desktop serve` (the stack's `desktop`).

The local provider's machinery (envs/desktop/local.py) starts one desktop on the
display and ports the service was given, not free ones, because its clients (the
gateway's registered desktop envs) are configured with them; the state server
(envs/desktop/state_server.py) then serves that desktop's shell. Remote desktop envs
connect to both like to an OSWorld VM.

It runs until SIGTERM or SIGINT, then stops the state server and the desktop (every
process of it, apps included) and exits 0. If one of the desktop's own servers dies
(Xvfb, openbox, x11vnc, websockify) the health route turns 503 and the service exits 1,
so a container's restart policy brings up a whole new desktop instead of half of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from envs.desktop.local import LocalDesktopProvider
from envs.desktop.processes import port_is_free
from envs.desktop.remote import API_KEY_ENV
from envs.desktop.state_server import create_app

log = logging.getLogger("agentflow.desktop")
WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ServeOptions:
    display: int
    vnc_port: int
    novnc_port: int
    state_port: int
    api_key: str | None
    development: bool = False
    screen: tuple[int, int] = (1280, 800)
    runtime_dir: Path | None = None
    start_timeout_s: float = 60.0
    unsafe_host_user: bool = False


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: :func:`serve` owns SIGTERM (uvicorn's
    would re-raise it after shutdown and kill the process before the desktop is down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def novnc_url(options: ServeOptions) -> str:
    """The page a remote desktop env is registered with (noVNC finds the websocket on the
    page's own host and port)."""
    return f"http://127.0.0.1:{options.novnc_port}/vnc.html?autoconnect=1&resize=off"


async def serve(options: ServeOptions) -> int:
    """Run the desktop and its state server until a signal (0) or a broken desktop (1)."""
    # Checked before anything starts (create_app checks the key again, too late for that).
    if not options.api_key and not options.development:
        raise ValueError(f"the desktop state server needs an API key ({API_KEY_ENV})")
    if not port_is_free(options.state_port):
        raise ValueError(f"127.0.0.1:{options.state_port} (the state server's) is in use")
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    provider = LocalDesktopProvider(
        max_desktops=1,
        runtime_dir=options.runtime_dir,
        start_timeout_s=options.start_timeout_s,
        display=options.display,
        vnc_port=options.vnc_port,
        ws_port=options.novnc_port,
        unsafe_host_user=options.unsafe_host_user,
    )
    try:
        return await _serve(options, provider, stopping)
    finally:
        await provider.aclose()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _serve(
    options: ServeOptions, provider: LocalDesktopProvider, stopping: asyncio.Event
) -> int:
    starting = asyncio.ensure_future(provider.start(options.screen))
    stop_wait = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal during start-up: nothing to serve
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    desktop = starting.result()
    assert desktop.shell is not None

    async def health() -> str | None:
        exited = provider.exited(desktop)
        return f"exited: {', '.join(exited)}" if exited else None

    app = create_app(
        desktop.shell, api_key=options.api_key, development=options.development, health=health
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", options.state_port))
    config = uvicorn.Config(app, log_level="info", lifespan="off", access_log=False)
    server = _Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    log.info(
        "desktop %s on display %s: noVNC %s, state server http://127.0.0.1:%d",
        desktop.id, desktop.display, novnc_url(options), options.state_port,
    )  # fmt: skip
    code = 0
    try:
        while not stopping.is_set() and not serving.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop_wait), WATCH_INTERVAL_S)
            if problem := await health():
                log.error("the desktop broke (%s): stopping", problem)
                code = 1
                break
        if serving.done() and not stopping.is_set():
            code = 1  # the state server ended on its own (it could not serve)
    finally:
        server.should_exit = True
        await serving
        stop_wait.cancel()
        sock.close()
    return code
