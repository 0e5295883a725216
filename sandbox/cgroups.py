"""Per-sandbox control groups: a memory and process-count limit for a whole process tree.

rlimits bound one process at a time; a cgroup bounds the sum over every process a
sandbox starts, which is what stops ``N x (limit - 1)`` allocations and fork bombs.

Two layouts are supported:

* cgroup v2 (unified): one directory with ``memory.max``, ``pids.max``; kills via
  ``cgroup.kill``. It needs a cgroup whose ``subtree_control`` can enable ``memory`` and
  ``pids``, i.e. one without processes of its own (pass ``parent=`` for a delegated one).
* cgroup v1 (hybrid hosts): one directory in each of the ``memory`` and ``pids``
  hierarchies, nested under the caller's own cgroup so the caller's limits still hold.

:func:`create_cgroup` returns ``None`` where neither is writable; callers then fall back
to rlimits alone and say so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str:
    """The caller's cgroup path in ``controller``'s hierarchy ("" for the v2 line)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path.lstrip("/")
    raise LookupError(controller)


class SandboxCgroup:
    """One sandbox's cgroup(s): set limits, join, count OOM kills, kill all, remove."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        # controller name -> directory; for v2 a single "" key.
        self.dirs = dirs
        self.version = version

    @property
    def procs_files(self) -> list[str]:
        """Files a new process writes ``0`` into to join (done before exec)."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def set_limits(self, memory_bytes: int, max_pids: int) -> None:
        if self.version == 2:
            d = self.dirs[""]
            (d / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # absent when swap accounting is off
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(max_pids))
            return
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (self.dirs["pids"] / "pids.max").write_text(str(max_pids))

    def oom_kills(self) -> int:
        """How many processes the kernel has OOM-killed in this cgroup so far."""
        if self.version == 2:
            text = (self.dirs[""] / "memory.events").read_text()
        else:
            text = (self.dirs["memory"] / "memory.oom_control").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup; True once it is empty."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                (self.dirs[""] / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:  # v1 has no cgroup.kill; pids.max bounds how many can respawn
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()


def create_cgroup(name: str, parent: str | os.PathLike[str] | None = None) -> SandboxCgroup | None:
    """Create cgroup(s) named ``name``; ``None`` when this host does not let us."""
    try:
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            return _create_v2(name, Path(parent) if parent else None)
        return _create_v1(name)
    except (OSError, LookupError, ValueError):
        return None


def _create_v2(name: str, parent: Path | None) -> SandboxCgroup | None:
    base = parent or CGROUP_ROOT / _own_path("")
    wanted = {"memory", "pids"}
    if not wanted <= set((base / "cgroup.controllers").read_text().split()):
        return None
    enabled = set((base / "cgroup.subtree_control").read_text().split())
    if not wanted <= enabled:
        # EBUSY when ``base`` holds processes itself (the "no internal processes" rule).
        (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
    d = base / name
    d.mkdir()
    return SandboxCgroup({"": d}, version=2)


def _create_v1(name: str) -> SandboxCgroup | None:
    dirs: dict[str, Path] = {}
    try:
        for controller in ("memory", "pids"):
            hierarchy = CGROUP_ROOT / controller
            if not (hierarchy / "cgroup.procs").exists():
                raise LookupError(controller)
            d = hierarchy / _own_path(controller) / name
            d.mkdir()
            dirs[controller] = d
    except BaseException:
        for d in dirs.values():
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return SandboxCgroup(dirs, version=1)
