"""A local desktop inside the project's sandbox: the default for local desktops.

A policy in training types whatever it samples into the desktop's terminal, so the
desktop's processes (Xvfb, openbox, x11vnc, websockify and every app) run under
bubblewrap with the isolation of sandbox/bwrap.py:

* their own user, pid, mount, IPC, UTS and network namespaces; uid 65534, no
  capabilities, no new user namespaces; where the gateway runs as root, bwrap itself is
  started as host uid 65534, so even an escape lands as `nobody`;
* a read-only `/usr` and the handful of `/etc` files a program needs (plus fonts and the
  X11/XDG configuration); nothing of the gateway's files, environment or sockets;
* a home (`/home/desktop`) and a `/tmp` that are capped tmpfs mounts on the host (bytes
  and files; ENOSPC past the cap), and one memory + pids cgroup for the whole desktop
  whose memory limit is `memory_mb` plus both caps;
* no network at all but the namespace's own loopback. The two ports the host reaches
  (VNC and noVNC's websocket) leave the sandbox as Unix sockets in a folder bound at
  `/run/desktop`; this module serves them on 127.0.0.1 with a relay. A process in the
  desktop cannot reach the database, the gateway or anything else on the host's loopback.

The first process in the sandbox is envs/desktop/sandbox_init.py (standard library
only, run by the system's python3): it starts the servers, reports readiness, and runs
the host's shell requests (`run`, `launch`) over its stdin and stdout. Files of the home
are read and written from the host without following symlinks (sandbox/workdir.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import resource
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from envs.base import EnvError
from envs.desktop.processes import (
    MARKER_ENV,
    OWNER_ENV,
    SANDBOX_MOUNTS,
    die_with,
    remove_sandbox_dir,
)
from envs.desktop.provider import CommandResult
from sandbox.base import SandboxFileError
from sandbox.bwrap import NOBODY, enter_sandbox, namespace_args, tmp_args
from sandbox.cgroups import SandboxCgroup, create_cgroup
from sandbox.tmpfs import mount_tmpfs, unmount
from sandbox.workdir import read_beneath, relative_path, write_beneath

logger = logging.getLogger(__name__)

INIT_SOURCE = Path(__file__).with_name("sandbox_init.py")
INSIDE_HOME = "/home/desktop"
INSIDE_RUN = "/run/desktop"
INSIDE_INIT = "/opt/agentflow/desktop_init.py"
SYSTEM_PYTHON = "/usr/bin/python3"
# What X, the window manager and xterm read besides /usr: fonts, X11 and XDG settings.
DESKTOP_ETC = ("fonts", "X11", "xdg")
MAX_FILE_BYTES = 10 * 2**20
MIB = 2**20


class DesktopLimits(BaseModel):
    """What one sandboxed desktop may use, all its processes together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(default=2048, ge=128, le=65536, description="processes' memory")
    max_processes: int = Field(default=512, ge=16, le=8192, description="processes at once")
    home_mb: int = Field(default=256, ge=1, le=65536, description="bytes the home may hold")
    home_files: int = Field(default=65_536, ge=64, le=10_000_000, description="home's files")
    tmp_mb: int = Field(default=128, ge=1, le=65536, description="bytes /tmp may hold")
    tmp_files: int = Field(default=65_536, ge=64, le=10_000_000, description="/tmp's files")
    max_file_mb: int = Field(default=64, ge=1, le=65536, description="largest file written")


class SandboxedDesktop:
    """One desktop's sandbox: its mounts, cgroup, bwrap process, init channel and relays."""

    def __init__(
        self,
        desktop_id: str,
        folder: Path,
        *,
        limits: DesktopLimits,
        novnc_dir: Path,
        sandbox_root: Path | None = None,
        bwrap: str | None = None,
    ) -> None:
        self.id = desktop_id
        self.folder = folder  # the host's own: logs, never mounted into the sandbox
        self.root = sandbox_root or default_sandbox_root()
        self.sandbox_dir = self.root / desktop_id  # what the sandbox sees of the host
        self.limits = limits
        self.novnc_dir = novnc_dir
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise EnvError("sandboxed desktops need bubblewrap: apt-get install bubblewrap")
        self._bwrap = found
        self.home = self.sandbox_dir / "home"
        self._tmp = self.sandbox_dir / "tmp"
        self._run = self.sandbox_dir / "run"
        self._as_root = os.geteuid() == 0
        self._owner = (NOBODY, NOBODY) if self._as_root else None
        self._mounted: list[Path] = []
        self.cgroup: SandboxCgroup | None = None
        self.process: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._ready: asyncio.Future[str] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._relays: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.exited: dict[str, int] = {}  # the desktop's own servers that exited: code

    @property
    def capped(self) -> bool:
        """Whether the home and /tmp are capped tmpfs mounts (False where mounting is not
        allowed: plain folders, only the per-file size cap holds)."""
        return len(self._mounted) == 2

    # -- start --------------------------------------------------------------------------

    async def start(
        self, screen: tuple[int, int], display: int | None, start_timeout_s: float
    ) -> str:
        """Bring the desktop up; its display (inside the sandbox)."""
        await asyncio.to_thread(self._prepare)
        config = {
            "screen": list(screen),
            "display": 0 if display is None else display,
            "novnc_dir": str(self.novnc_dir),
        }
        log = open(self.folder / "desktop.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self._argv(config),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env={MARKER_ENV: self.id, OWNER_ENV: str(self.folder)},  # bwrap's own too
                process_group=0,
                preexec_fn=self._child_setup(),
                limit=1 << 22,
            )
        finally:
            log.close()
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        async with asyncio.timeout(start_timeout_s):
            return await asyncio.shield(self._ready)

    def _prepare(self) -> None:
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        if self._as_root:  # bwrap runs as host nobody: it must reach what it binds
            for d in (self.root.resolve(), *self.root.resolve().parents):
                if not d.stat().st_mode & stat.S_IXOTH:
                    raise EnvError(f"{self.root}: {d} is not searchable by uid {NOBODY}")
        self.sandbox_dir.mkdir(mode=0o711)
        limits = self.limits
        assert tuple(p.name for p in (self.home, self._tmp)) == SANDBOX_MOUNTS
        for path, size, files, mode in (
            (self.home, limits.home_mb * MIB, limits.home_files, 0o700),
            (self._tmp, limits.tmp_mb * MIB, limits.tmp_files, 0o1777),
        ):
            path.mkdir(mode=0o700)
            uid, gid = self._owner or (os.getuid(), os.getgid())
            if mount_tmpfs(
                str(path), size_bytes=size, max_inodes=files + 1, uid=uid, gid=gid, mode=mode
            ):
                self._mounted.append(path)
            elif self._owner:
                os.chown(path, *self._owner)
        self._run.mkdir(mode=0o700)
        if self._owner:
            os.chown(self._run, *self._owner)
        shutil.copyfile(INIT_SOURCE, self.sandbox_dir / "init.py")
        os.chmod(self.sandbox_dir / "init.py", 0o644)
        self.cgroup = create_cgroup(f"agentflow-desktop-{self.id}")
        if self.cgroup is not None:
            memory = (limits.memory_mb + limits.tmp_mb + limits.home_mb) * MIB
            self.cgroup.set_limits(memory, limits.max_processes)

    def _argv(self, config: dict[str, Any]) -> list[str]:
        args = namespace_args(self._bwrap, network=False, hostname="desktop")
        for name in DESKTOP_ETC:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        tmp = str(self._tmp) if self._tmp in self._mounted else None
        args += tmp_args(tmp, self.limits.tmp_mb * MIB)
        args += ["--bind", str(self.home), INSIDE_HOME, "--bind", str(self._run), INSIDE_RUN]
        args += ["--ro-bind", str(self.sandbox_dir / "init.py"), INSIDE_INIT]
        if not self.novnc_dir.is_relative_to("/usr"):
            args += ["--ro-bind", str(self.novnc_dir), str(self.novnc_dir)]
        args += ["--remount-ro", "/", "--chdir", INSIDE_HOME, "--clearenv"]
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": INSIDE_HOME,
            "USER": "desktop",
            "LANG": "C.UTF-8",
            "SHELL": "/bin/bash",
            MARKER_ENV: self.id,
            # Whose desktop this is: the owner's folder for it (as HOME says in the
            # host-user mode), so a process list tells desktops of two providers apart.
            OWNER_ENV: str(self.folder),
        }
        for key, value in env.items():
            args += ["--setenv", key, value]
        return [*args, "--", SYSTEM_PYTHON, "-I", "-u", INSIDE_INIT, json.dumps(config)]

    def _child_setup(self) -> Callable[[], None]:
        """Between fork and exec of bwrap: join the cgroup, set rlimits, drop to nobody,
        then die with this process (set last: a change of uid clears it)."""
        rlimits = [
            (resource.RLIMIT_FSIZE, (self.limits.max_file_mb * MIB,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if self.cgroup is None:  # no cgroup here: per-process bounds are all there is
            rlimits.append((resource.RLIMIT_AS, (self.limits.memory_mb * MIB,) * 2))
            rlimits.append((resource.RLIMIT_NPROC, (self.limits.max_processes,) * 2))
        procs_files = self.cgroup.procs_files if self.cgroup else []
        drop = self._as_root
        die = die_with(os.getpid())

        def setup() -> None:
            enter_sandbox(procs_files, rlimits, drop)
            die()

        return setup

    async def serve_port(self, name: str, port: int) -> None:
        """Relay 127.0.0.1:`port` on the host to the desktop's `name` socket."""
        socket_path = str(self._run / f"{name}.sock")

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._connections.add(task)
            try:
                inner_reader, inner_writer = await asyncio.open_unix_connection(socket_path)
            except OSError:
                writer.close()
                self._connections.discard(task)
                return
            try:
                await asyncio.gather(_pump(reader, inner_writer), _pump(inner_reader, writer))
            except asyncio.CancelledError:
                inner_writer.close()  # the desktop is closing: end both sides quietly
                writer.close()
            finally:
                self._connections.discard(task)

        self._relays.append(await asyncio.start_server(connection, "127.0.0.1", port))

    # -- the init's channel -------------------------------------------------------------

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                self._dispatch(message)
        finally:
            lost = EnvError(f"the desktop's sandbox exited (see {self.folder / 'desktop.log'})")
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(lost)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(lost)
            self._pending.clear()

    def _dispatch(self, message: dict[str, Any]) -> None:
        event = message.get("event")
        assert self._ready is not None
        if event == "ready" and not self._ready.done():
            self._ready.set_result(str(message["display"]))
        elif event == "failed" and not self._ready.done():
            self._ready.set_exception(EnvError(f"the desktop did not start: {message['error']}"))
        elif event == "exited":
            self.exited[str(message["service"])] = int(message["code"])
        elif (future := self._pending.pop(message.get("id", -1), None)) is not None:
            if not future.done():
                future.set_result(message)

    async def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        process = self.process
        if process is None or process.stdin is None or process.returncode is not None:
            raise EnvError("the desktop's sandbox is not running")
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            process.stdin.write(json.dumps({"id": request_id, **payload}).encode() + b"\n")
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._pending.pop(request_id, None)
            raise EnvError("the desktop's sandbox is not running") from exc
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    # -- stop ---------------------------------------------------------------------------

    async def close(self) -> None:
        for server in self._relays:
            server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        process = self.process
        if process is not None and process.returncode is None:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()  # init stops the desktop on EOF
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await process.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, 9)  # bwrap's pid namespace goes with it
            await process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        try:
            if self.cgroup is not None:
                self.cgroup.kill_all()
            for path in self._mounted:  # before the cgroup goes: its pages are charged there
                unmount(str(path))
            self._mounted.clear()
        finally:
            if self.cgroup is not None:
                self.cgroup.remove()
                self.cgroup = None
            remove_sandbox_dir(self.sandbox_dir)  # unmounts anything left, then removes


class SandboxShell:
    """`DesktopShell` of a sandboxed desktop: commands through its init, files through
    the host side of its home (never following a symlink the desktop planted)."""

    def __init__(self, sandbox: SandboxedDesktop) -> None:
        self._sandbox = sandbox
        self.home = sandbox.home
        self._owner = (NOBODY, NOBODY) if os.geteuid() == 0 else None

    async def run(self, command: str, timeout_s: float = 10.0) -> CommandResult:
        reply = await self._sandbox.request(
            {"op": "run", "command": command, "timeout_s": timeout_s}
        )
        if "error" in reply:
            return CommandResult(127, "", str(reply["error"]))
        return CommandResult(int(reply["exit_code"]), reply["stdout"], reply["stderr"])

    async def read_file(self, path: str) -> bytes | None:
        relative = home_relative(path)
        try:
            return await asyncio.to_thread(
                read_beneath, str(self.home), relative, max_bytes=MAX_FILE_BYTES
            )
        except SandboxFileError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOENT:
                return None
            if "not a directory inside" in str(exc):  # a parent that does not exist
                return None
            raise ValueError(str(exc)) from exc

    async def write_file(self, path: str, data: bytes) -> None:
        relative = home_relative(path)
        try:
            await asyncio.to_thread(
                write_beneath,
                str(self.home),
                relative,
                data,
                max_bytes=MAX_FILE_BYTES,
                owner=self._owner,
            )
        except SandboxFileError as exc:
            raise ValueError(str(exc)) from exc

    async def launch(self, argv: Sequence[str]) -> None:
        reply = await self._sandbox.request({"op": "launch", "argv": list(argv)})
        if "error" in reply:
            raise EnvError(f"could not launch {argv[0]!r} in the desktop: {reply['error']}")


def home_relative(path: str) -> str:
    """`path` (relative to the home, `~/...`, or absolute under the desktop's home) as a
    path relative to the home; anything else is refused."""
    relative = path
    if path.startswith("~/"):
        relative = path[2:]
    elif path.startswith(INSIDE_HOME + "/"):
        relative = path[len(INSIDE_HOME) + 1 :]
    try:
        return str(relative_path(relative))
    except SandboxFileError:
        raise ValueError(f"{path!r} is outside the desktop's home") from None


def default_sandbox_root() -> Path:
    return Path(tempfile.gettempdir()) / "agentflow-desktop-sandboxes"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
