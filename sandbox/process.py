"""Run one host process with capped output capture, a wall-clock deadline and a hard kill.

This is the plumbing under the bubblewrap backend (the process is ``bwrap``, which takes
its whole sandboxed tree down with it when killed); it isolates nothing by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sandbox.base import SandboxError

_CHUNK = 1 << 16
# After a kill, how long the pipes may take to reach EOF before readers are abandoned.
_DRAIN_GRACE_S = 5.0
# How long a kill waits for the leader to stop before it takes the tree down.
_STOP_WAIT_S = 0.5


@dataclass
class _Capture:
    limit: int
    overflow: asyncio.Event
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    truncated: bool = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_CHUNK):
            room = self.limit - self.size
            if len(chunk) > room:
                chunk = chunk[: max(room, 0)]
                self.truncated = True
                self.overflow.set()
            if chunk:
                self.chunks.append(chunk)
                self.size += len(chunk)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class ProcessRun:
    """What a captured process did; ``returncode`` is None when we killed it."""

    stdout: bytes
    stderr: bytes
    returncode: int | None
    timed_out: bool
    output_overflow: bool
    duration_s: float


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    # The command may exit without reading its input: that is its business, not an error.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.close()
        await stream.wait_closed()


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    # Our child leads its own session (start_new_session): take the group down with it,
    # and first the children that left the group. bwrap's namespace init does (it starts
    # a session of its own), and it follows its parent only once it has set its parent-
    # death signal: a bwrap killed before then would leave it, and the command, running.
    # So the leader is stopped (it can start no more children), its children are killed,
    # then the group. Not proc.kill(): it polls first, and a leader the group kill just
    # ended would be reaped there, behind the back of asyncio's child watcher.
    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return
    _wait_stopped(proc.pid)
    for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child, signal.SIGKILL)  # when it leads a group (its own session)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name (state, ppid, ...); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return []
    return raw[raw.rfind(b")") + 2 :].decode().split()


def _wait_stopped(pid: int) -> None:
    """Until `pid` has stopped (a signal lands on the way back to user space, so an
    unfinished fork completes first); bounded, it is about to be killed anyway."""
    deadline = time.monotonic() + _STOP_WAIT_S
    while time.monotonic() < deadline:
        fields = _stat_fields(pid)
        if not fields or fields[0] in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0005)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a scan of /proc: the kernel's own children
    list is an optional build option)."""
    parent = str(pid)
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(name)
            if len(fields) > 1 and fields[1] == parent:
                found.append(int(name))
    return found


def _kill_spawned(spawning: asyncio.Future[asyncio.subprocess.Process]) -> None:
    if not spawning.cancelled() and spawning.exception() is None:
        _kill(spawning.result())


async def run_captured(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ProcessRun:
    """Run ``argv``; kill it at ``timeout_s`` or once either stream passes the cap."""
    overflow = asyncio.Event()
    out, err = _Capture(max_output_bytes, overflow), _Capture(max_output_bytes, overflow)
    start = time.monotonic()
    spawning = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            preexec_fn=preexec_fn,
            start_new_session=True,
            close_fds=True,
        )
    )
    try:
        proc = await asyncio.shield(spawning)
    except asyncio.CancelledError:
        # asyncio's own clean-up of a start cancelled half way kills the leader alone,
        # then waits for its pipes to close: a child that outlived it (bwrap's namespace
        # init, in a session of its own, when the leader died before it could take it
        # along) holds them open for ever. So the start runs to its end, then the whole
        # tree goes (`_kill`), and the caller's cancellation is not held up meanwhile.
        spawning.add_done_callback(_kill_spawned)
        raise
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"could not start {argv[0]!r}: {exc}") from exc

    assert proc.stdout is not None and proc.stderr is not None
    helpers = [
        asyncio.create_task(out.drain(proc.stdout)),
        asyncio.create_task(err.drain(proc.stderr)),
    ]
    if stdin is not None and proc.stdin is not None:
        helpers.append(asyncio.create_task(_feed(proc.stdin, stdin)))
    waiter = asyncio.create_task(proc.wait())
    overflowed = asyncio.create_task(overflow.wait())
    timed_out = False
    try:
        done, _ = await asyncio.wait(
            {waiter, overflowed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            timed_out = not overflow.is_set()
            _kill(proc)
        await waiter
        # Pipes reach EOF once every process holding them is gone.
        _, pending = await asyncio.wait(helpers, timeout=_DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
    finally:
        # Also on cancellation of the caller: never leave the process running.
        _kill(proc)
        overflowed.cancel()
        waiter.cancel()
        for task in helpers:
            task.cancel()
    killed = timed_out or overflow.is_set()
    return ProcessRun(
        stdout=out.data,
        stderr=err.data,
        returncode=None if killed else proc.returncode,
        timed_out=timed_out,
        output_overflow=out.truncated or err.truncated,
        duration_s=time.monotonic() - start,
    )
