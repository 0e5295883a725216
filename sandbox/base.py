"""The Sandbox protocol and its types.

A sandbox runs untrusted commands (tool code written by a model) in an isolated work
directory with limits on wall time, CPU time, memory, processes, file size and captured
output. Every backend implements :class:`Sandbox`; each states in its docstring what it
isolates and what it does not.

Exceptions::

    SandboxError                  anything the sandbox itself could not do
    ├── SandboxUnavailable        the backend cannot start here (no bwrap, no docker engine)
    ├── SandboxClosed             the sandbox was used after close()
    └── SandboxFileError          a file path escapes the work dir, the file is missing/too big,
                                  or the work dir is full

A command that fails, times out or runs out of memory is *not* an exception: it is an
:class:`ExecResult` with the matching :class:`ExecStatus`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class ExecStatus(StrEnum):
    """How a command ended."""

    FINISHED = "finished"  # exited on its own (any exit code)
    ERROR = "error"  # killed by a signal, or could not be started
    TIME_LIMIT = "time_limit"  # wall time or CPU time ran out
    MEMORY_LIMIT = "memory_limit"  # memory limit hit (OOM kill or failed allocation)


class SandboxLimits(BaseModel):
    """Resource limits for one sandbox; every exec in it runs under them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_time_s: float = Field(default=10.0, gt=0, le=3600, description="Wall time per exec (s).")
    cpu_time_s: float = Field(default=10.0, gt=0, le=3600, description="CPU time per process (s).")
    memory_mb: int = Field(default=512, ge=16, le=65536, description="Memory limit (MiB).")
    max_processes: int = Field(default=64, ge=1, le=4096, description="Processes at once.")
    max_output_bytes: int = Field(
        default=1_000_000, ge=1024, le=256_000_000, description="Captured bytes per stream."
    )
    max_file_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, le=16 * 1024**3, description="Largest file written."
    )
    max_workdir_bytes: int = Field(
        default=1024**3,
        ge=1024 * 1024,
        le=64 * 1024**3,
        description="Total bytes the work dir may hold; it lives in memory (tmpfs), so this "
        "is also added to the sandbox's memory cgroup limit.",
    )
    max_workdir_files: int = Field(
        default=100_000,
        ge=16,
        le=10_000_000,
        description="Files and directories the work dir may hold (its inode cap).",
    )


class ExecResult(BaseModel):
    """What one exec produced."""

    model_config = ConfigDict(extra="forbid")

    stdout: str
    stderr: str
    exit_code: int | None = Field(description="None when killed by the sandbox or not started.")
    status: ExecStatus
    duration_s: float = Field(ge=0)
    output_truncated: bool = False


class SandboxError(Exception):
    """The sandbox itself failed (not the command inside it)."""


class SandboxUnavailable(SandboxError):
    """The backend cannot run on this host."""


class SandboxClosed(SandboxError):
    """The sandbox was used after close()."""


class SandboxFileError(SandboxError):
    """A file path is invalid (absolute, escapes the work dir), missing, too large, or the
    work dir is full."""


Command = Sequence[str] | str


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run commands and keep files between them."""

    async def exec(
        self,
        cmd: Command,
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (argv list, or a string run by ``/bin/sh -c``) in the work dir.

        ``cwd`` is relative to the work dir; ``timeout_s`` may only shorten the wall-time
        limit. Never raises for what the command does; raises :class:`SandboxError` only
        when the sandbox itself fails.
        """
        ...

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file, ``path`` relative to the work dir (parents are created)."""
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file, ``path`` relative to the work dir."""
        ...

    async def close(self) -> None:
        """Release everything the sandbox holds; safe to call twice."""
        ...
