"""Local desktops: Xvfb + openbox + x11vnc + websockify/noVNC, one set per desktop.

By default each desktop runs inside the project's sandbox (envs/desktop/sandboxed.py):
its own namespaces, uid 65534, a capped home and /tmp, one cgroup, no network but the
VNC and noVNC ports relayed to the host's loopback. A policy typing into its terminal
types into that sandbox. `unsafe_host_user=True` (`AGENTFLOW_DESKTOP_UNSAFE_HOST_USER=1`,
`agentflow desktop serve --unsafe-host-user`) runs the same processes as the gateway's
own user on the host instead, as described below: only for a desktop that is already
inside its own boundary (the compose stack's desktop container) or for trusted players.

Each desktop gets its own X display (Xvfb picks a free number and reports it through
`-displayfd`), its own home (a fresh folder; HOME points there and apps start in it),
x11vnc on its own loopback port and websockify serving Debian's noVNC page on another,
both bound to 127.0.0.1 (`display`, `vnc_port` and `ws_port` pin them instead, for the
one desktop of `agentflow desktop serve`, whose clients are configured with them).
Readiness is polled (the display reported, the window manager announced on the root
window, each port accepting), never slept for. At most
`max_desktops` run at once; a start past that waits `capacity_wait_s`, then raises
:class:`EnvCapacity`.

Nothing outlives the owner (envs/desktop/processes.py): own process groups, a
parent-death signal, a marker in every process's environment, and an `owner.json` per
desktop under `runtime_dir` (default `$XDG_RUNTIME_DIR/agentflow-desktops`, else
`/tmp/agentflow-desktops-<uid>`) so the next provider to start reaps a crashed one's
leftovers.

The host-user mode isolates the display, the home, the VNC ports, the environment (apps
see only PATH, HOME, USER, LANG, DISPLAY and the marker, never the gateway's own
variables). It does not isolate the rest: apps run as the gateway's user on the host
filesystem, so a terminal in the desktop is a shell on the host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from envs.base import EnvCapacity, EnvClosed, EnvError
from envs.desktop.processes import (
    MARKER_ENV,
    free_port,
    kill_marked,
    port_is_free,
    reap_orphans,
    spawn,
    terminate,
    wait_port,
    write_owner,
)
from envs.desktop.provider import CommandResult, Desktop, DesktopShell
from envs.desktop.sandboxed import DesktopLimits, SandboxedDesktop, SandboxShell

logger = logging.getLogger(__name__)

NOVNC_DIR = Path("/usr/share/novnc")
REQUIRED_COMMANDS = ("Xvfb", "openbox", "x11vnc", "websockify", "xprop")
UNSAFE_HOST_USER_ENV = "AGENTFLOW_DESKTOP_UNSAFE_HOST_USER"
MAX_FILE_BYTES = 10 * 2**20


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "agentflow-desktops"
    return Path(f"/tmp/agentflow-desktops-{os.getuid()}")


@dataclass
class _Running:
    desktop: Desktop
    folder: Path
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    ports: tuple[int, ...] = ()
    holds_slot: bool = True
    services: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    sandbox: SandboxedDesktop | None = None


class LocalShell:
    """`DesktopShell` of a local desktop: commands and apps run in its X session."""

    def __init__(self, running: _Running, env: dict[str, str], home: Path) -> None:
        self._running, self._env, self.home = running, env, home

    async def run(self, command: str, timeout_s: float = 10.0) -> CommandResult:
        proc = await spawn(["sh", "-c", command], env=self._env, cwd=self.home, capture=True)
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            await terminate([proc], grace_s=0)
            return CommandResult(124, "", f"timed out after {timeout_s} s")
        return CommandResult(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def read_file(self, path: str) -> bytes | None:
        target = self._inside(path)
        if not target.is_file():
            return None
        with open(target, "rb") as f:
            return f.read(MAX_FILE_BYTES)

    async def write_file(self, path: str, data: bytes) -> None:
        target = self._inside(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def launch(self, argv: Sequence[str]) -> None:
        log = self._running.folder / "apps.log"
        proc = await spawn(argv, env=self._env, cwd=self.home, log=log)
        self._running.procs.insert(0, proc)  # stopped before the X server

    def _inside(self, path: str) -> Path:
        relative = path.removeprefix("~/").lstrip("/") if path.startswith("~/") else path
        target = (self.home / relative).resolve()
        if not target.is_relative_to(self.home.resolve()):
            raise ValueError(f"{path!r} is outside the desktop's home")
        return target


class LocalDesktopProvider:
    """`DesktopProvider` that runs desktops as local processes."""

    def __init__(
        self,
        *,
        max_desktops: int = 4,
        runtime_dir: Path | None = None,
        start_timeout_s: float = 30.0,
        capacity_wait_s: float = 60.0,
        novnc_dir: Path = NOVNC_DIR,
        display: int | None = None,
        vnc_port: int | None = None,
        ws_port: int | None = None,
        unsafe_host_user: bool = False,
        limits: DesktopLimits | None = None,
        sandbox_root: Path | None = None,
    ) -> None:
        if max_desktops < 1:
            raise ValueError("max_desktops must be >= 1")
        self.fixed_display, self.fixed_vnc_port, self.fixed_ws_port = display, vnc_port, ws_port
        if (display, vnc_port, ws_port) != (None, None, None) and max_desktops != 1:
            raise ValueError("a fixed display or fixed ports serve one desktop: max_desktops=1")
        self.runtime_dir = runtime_dir or default_runtime_dir()
        self.start_timeout_s = start_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.novnc_dir = novnc_dir
        self._slots = asyncio.Semaphore(max_desktops)
        self._running: dict[str, _Running] = {}
        self._ports: set[int] = set()
        self._reaped = False
        self._closed = False
        self.unsafe_host_user = unsafe_host_user
        self.limits = limits or DesktopLimits()
        self.sandbox_root = sandbox_root
        if unsafe_host_user:
            logger.warning(
                "local desktops run as this process's user on the host (unsafe_host_user): "
                "a terminal in them is a shell on this machine"
            )

    async def start(self, screen: tuple[int, int] = (1280, 800)) -> Desktop:
        if self._closed:
            raise EnvClosed("the desktop provider is closed")
        needed = REQUIRED_COMMANDS if self.unsafe_host_user else (*REQUIRED_COMMANDS, "bwrap")
        missing = [c for c in needed if shutil.which(c) is None]
        if missing or not (self.novnc_dir / "vnc.html").is_file():
            raise EnvError(
                f"local desktops need {missing or 'novnc'}: apt-get install xvfb openbox "
                "x11vnc websockify novnc x11-utils bubblewrap"
            )
        if not self._reaped:
            self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            await asyncio.to_thread(reap_orphans, self.runtime_dir)
            self._reaped = True
        try:
            await asyncio.wait_for(self._slots.acquire(), self.capacity_wait_s)
        except TimeoutError:
            raise EnvCapacity("every local desktop slot is taken; retry later") from None
        return await self._start(screen)  # the slot now belongs to the desktop's record

    async def _start(self, screen: tuple[int, int]) -> Desktop:
        desktop_id = uuid.uuid4().hex[:12]
        folder = self.runtime_dir / desktop_id
        home = folder / "home"
        running = _Running(Desktop(desktop_id, "", screen), folder)
        self._running[desktop_id] = running
        try:
            async with asyncio.timeout(self.start_timeout_s):
                if not self.unsafe_host_user:
                    return await self._bring_up_sandboxed(running, screen)
                home.mkdir(parents=True, mode=0o700)
                return await self._bring_up(running, home, screen)
        except BaseException as exc:
            await self._teardown(desktop_id)
            if isinstance(exc, TimeoutError):
                raise EnvError(f"desktop did not start within {self.start_timeout_s} s") from None
            raise

    async def _bring_up_sandboxed(self, running: _Running, screen: tuple[int, int]) -> Desktop:
        desktop_id, folder = running.desktop.id, running.folder
        folder.mkdir(parents=True, mode=0o700)
        sandbox = SandboxedDesktop(
            desktop_id,
            folder,
            limits=self.limits,
            novnc_dir=self.novnc_dir,
            sandbox_root=self.sandbox_root,
        )
        running.sandbox = sandbox
        # Before anything is mounted: a crash from here on is reaped, mounts included.
        write_owner(folder, [], sandbox_dir=str(sandbox.sandbox_dir))
        display = await sandbox.start(screen, self.fixed_display, self.start_timeout_s)
        vnc_port = self.fixed_vnc_port or free_port(self._ports)
        ws_port = self.fixed_ws_port or free_port(self._ports)
        running.ports = (vnc_port, ws_port)
        for name, port in (("vnc", vnc_port), ("ws", ws_port)):
            try:
                await sandbox.serve_port(name, port)
            except OSError as exc:
                raise EnvError(f"127.0.0.1:{port} is already in use ({exc.strerror})") from exc
        assert sandbox.process is not None
        write_owner(
            folder, [sandbox.process.pid], display=display, sandbox_dir=str(sandbox.sandbox_dir)
        )
        query = f"autoconnect=1&resize=off&host=127.0.0.1&port={ws_port}&path=websockify"
        shell: DesktopShell = SandboxShell(sandbox)
        running.desktop = Desktop(
            id=desktop_id,
            novnc_url=f"http://127.0.0.1:{ws_port}/vnc.html?{query}",
            screen=screen,
            shell=shell,
            display=display,
            vnc_port=vnc_port,
            ws_port=ws_port,
            home=sandbox.home,
            info={"isolation": "sandbox"},
        )
        return running.desktop

    async def _bring_up(self, running: _Running, home: Path, screen: tuple[int, int]) -> Desktop:
        desktop_id, folder = running.desktop.id, running.folder
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "USER": os.environ.get("USER", "desktop"),
            "LANG": "C.UTF-8",
            "SHELL": "/bin/bash",
            MARKER_ENV: desktop_id,
        }
        display = await self._start_x(running, env, screen)
        env["DISPLAY"] = display
        shell = LocalShell(running, env, home)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s

        async def window_manager() -> None:
            wm = await spawn(["openbox"], env=env, cwd=home, log=folder / "wm.log")
            running.procs.append(wm)
            running.services["openbox"] = wm
            while not (await shell.run("xprop -root _NET_SUPPORTING_WM_CHECK")).stdout.count("#"):
                await asyncio.sleep(0.02)

        vnc_port = self.fixed_vnc_port or free_port(self._ports)
        ws_port = self.fixed_ws_port or free_port(self._ports)
        running.ports = (vnc_port, ws_port)
        for port in (p for p in (self.fixed_vnc_port, self.fixed_ws_port) if p is not None):
            if not port_is_free(port):  # else the readiness poll would find the squatter
                raise EnvError(f"127.0.0.1:{port} is already in use")
        vnc = [
            "x11vnc", "-display", display, "-localhost", "-rfbport", str(vnc_port), "-nopw",
            "-forever", "-shared", "-noipv6", "-quiet", "-defer", "10", "-wait", "10",
        ]  # fmt: skip
        web = ["websockify", "--web", str(self.novnc_dir), f"127.0.0.1:{ws_port}",
               f"127.0.0.1:{vnc_port}"]  # fmt: skip

        async def serve(argv: list[str], port: int, name: str) -> None:
            proc = await spawn(argv, env=env, cwd=home, log=folder / f"{name}.log")
            running.procs.append(proc)
            running.services[name] = proc
            if not await wait_port(port, proc, deadline):
                raise EnvError(f"{name} did not listen on 127.0.0.1:{port} (see {folder})")

        await asyncio.gather(
            window_manager(), serve(vnc, vnc_port, "x11vnc"), serve(web, ws_port, "websockify")
        )
        query = f"autoconnect=1&resize=off&host=127.0.0.1&port={ws_port}&path=websockify"
        running.desktop = Desktop(
            id=desktop_id,
            novnc_url=f"http://127.0.0.1:{ws_port}/vnc.html?{query}",
            screen=screen,
            shell=shell,
            display=display,
            vnc_port=vnc_port,
            ws_port=ws_port,
            home=home,
            info={"isolation": "unsafe-host-user"},
        )
        write_owner(folder, [p.pid for p in running.procs], display=display)
        return running.desktop

    async def _start_x(
        self, running: _Running, env: dict[str, str], screen: tuple[int, int]
    ) -> str:
        """Xvfb on a display it picks itself; the display once it accepts clients."""
        width, height = screen
        read_end, write_end = os.pipe()
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", 0)
        )
        try:
            fixed = [] if self.fixed_display is None else [f":{self.fixed_display}"]
            argv = ["Xvfb", *fixed, "-displayfd", str(write_end), "-screen", "0",
                    f"{width}x{height}x24", "-nolisten", "tcp", "-noreset"]  # fmt: skip
            log = running.folder / "xvfb.log"
            proc = await spawn(argv, env=env, cwd=running.folder, log=log, pass_fds=[write_end])
            running.procs.append(proc)
            running.services["Xvfb"] = proc
            os.close(write_end)
            write_end = -1
            # Xvfb writes the display number once it accepts clients; EOF if it died.
            number = (await reader.readline()).decode(errors="replace").strip()
        finally:
            transport.close()
            if write_end >= 0:
                os.close(write_end)
        if not number.isdigit():
            raise EnvError(f"Xvfb did not start (see {running.folder / 'xvfb.log'})")
        write_owner(running.folder, [proc.pid], display=f":{number}")
        return f":{number}"

    async def stop(self, desktop: Desktop) -> None:
        await self._teardown(desktop.id)

    async def _teardown(self, desktop_id: str) -> None:
        running = self._running.pop(desktop_id, None)
        if running is None:
            return
        try:
            if running.sandbox is not None:
                await running.sandbox.close()
            await terminate(running.procs)
            await asyncio.to_thread(kill_marked, desktop_id)
            await asyncio.to_thread(shutil.rmtree, running.folder, True)
        finally:
            self._ports.difference_update(running.ports)
            if running.holds_slot:
                running.holds_slot = False
                self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        await asyncio.gather(*(self._teardown(i) for i in list(self._running)))

    def exited(self, desktop: Desktop) -> list[str]:
        """Which of the desktop's own servers (not its apps) have exited: a broken desktop."""
        if (running := self._running.get(desktop.id)) is None:
            return ["the desktop (stopped)"]
        if (sandbox := running.sandbox) is not None:
            gone = sorted(sandbox.exited)
            if sandbox.process is None or sandbox.process.returncode is not None:
                gone.append("the desktop's sandbox")
            return gone
        return [name for name, proc in running.services.items() if proc.returncode is not None]

    @property
    def running(self) -> list[Desktop]:
        return [r.desktop for r in self._running.values()]
