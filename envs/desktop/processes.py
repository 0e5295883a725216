"""Processes of local desktops: started so that nothing outlives its owner.

Three layers, because each covers what the one before misses:

1. Every process is started in its own process group with a parent-death signal
   (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): when the owning process dies, even by SIGKILL,
   the kernel kills Xvfb, the window manager, x11vnc, websockify and the apps. The
   signal fires when the *thread* that forked the child ends, and asyncio forks in the
   event loop's thread, so a desktop lives as long as its loop's thread.
2. Every process carries `AGENTFLOW_DESKTOP=<desktop id>` in its environment, and so
   does everything *they* start (a shell's background job, websockify's per-connection
   workers, which the parent-death signal does not reach). `kill_marked` finds them by
   reading `/proc/*/environ` (the owner's own user's processes, or all as root).
3. Each desktop writes `owner.json` (owner pid and start time, the pids) in its runtime
   folder; :func:`reap_orphans` — run by a provider when it starts — kills what a
   crashed owner left (its own processes first died with it; this catches the rest)
   and removes the folder, and a sandboxed desktop's mounts and folder (`sandbox_dir`).
   The start time guards against a reused pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandbox.tmpfs import unmount

MARKER_ENV = "AGENTFLOW_DESKTOP"
OWNER_ENV = "AGENTFLOW_DESKTOP_FOLDER"  # a sandboxed desktop's folder on the host
OWNER_FILE = "owner.json"
# A sandboxed desktop's host-mounted tmpfs parts, under its `sandbox_dir`.
SANDBOX_MOUNTS = ("home", "tmp")
_PR_SET_PDEATHSIG = 1
_libc: Any = None


def die_with(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn`: send this child `sig` (SIGKILL) when its parent goes, and kill it
    if the parent already has."""
    global _libc
    if _libc is None:  # loaded before the fork: dlopen in a forked child is not safe
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


async def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log: Path | None = None,
    pass_fds: Sequence[int] = (),
    capture: bool = False,
) -> asyncio.subprocess.Process:
    """Start `argv` in its own process group, killed with this process."""
    out: Any = asyncio.subprocess.PIPE if capture else asyncio.subprocess.DEVNULL
    with contextlib.ExitStack() as stack:
        if log is not None and not capture:
            out = stack.enter_context(open(log, "ab"))
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.PIPE if capture else out,
            env=env,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
            process_group=0,
            preexec_fn=die_with(os.getpid()),
        )


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def terminate(procs: Sequence[asyncio.subprocess.Process], grace_s: float = 2.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after `grace_s`; reap them all."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    if waits:
        await asyncio.wait(waits, timeout=grace_s)
    for proc in procs:  # the leader may be gone while its group's members are not
        _signal_group(proc.pid, signal.SIGKILL)
    if waits:
        await asyncio.gather(*waits, return_exceptions=True)


def marked_pids(desktop_id: str) -> list[int]:
    """Pids of the processes whose environment names `desktop_id` (never this one)."""
    needle = f"{MARKER_ENV}={desktop_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def kill_marked(desktop_id: str) -> int:
    """SIGKILL every process marked with `desktop_id`; how many there were."""
    pids = marked_pids(desktop_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def write_owner(folder: Path, pids: Sequence[int], **extra: Any) -> None:
    """Record who owns the desktop in `folder` and which processes it started."""
    me = os.getpid()
    record = {"owner_pid": me, "owner_start": start_time(me), "pids": list(pids), **extra}
    tmp = folder / (OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(folder / OWNER_FILE)


def reap_orphans(runtime_dir: Path) -> list[str]:
    """Kill and remove the desktops under `runtime_dir` whose owner is dead; their ids."""
    reaped: list[str] = []
    if not runtime_dir.is_dir():
        return reaped
    for folder in runtime_dir.iterdir():
        try:
            record = json.loads((folder / OWNER_FILE).read_text())
            owner, started = int(record["owner_pid"]), record.get("owner_start")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not a desktop folder
        if start_time(owner) is not None and start_time(owner) == started:
            continue  # its owner is alive
        kill_marked(folder.name)
        if sandbox_dir := record.get("sandbox_dir"):
            remove_sandbox_dir(Path(sandbox_dir))
        shutil.rmtree(folder, ignore_errors=True)
        reaped.append(folder.name)
    return reaped


def remove_sandbox_dir(sandbox_dir: Path) -> None:
    """Unmount and remove a sandboxed desktop's host side (its processes are gone)."""
    for part in SANDBOX_MOUNTS:
        with contextlib.suppress(OSError):
            unmount(str(sandbox_dir / part))
    shutil.rmtree(sandbox_dir, ignore_errors=True)


def free_port(taken: set[int]) -> int:
    """A loopback port nobody listens on now (and not already handed out here)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


def port_is_free(port: int) -> bool:
    """Whether 127.0.0.1:`port` can be bound now (a fixed port somebody else holds is not).

    With SO_REUSEADDR, as the servers bind it: only a listener makes the port taken, not
    the TIME_WAIT connections a restarted service leaves behind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def wait_port(port: int, proc: asyncio.subprocess.Process, deadline: float) -> bool:
    """Poll until 127.0.0.1:`port` accepts; False if `proc` exits or time runs out."""
    loop = asyncio.get_running_loop()
    while proc.returncode is None and loop.time() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False
