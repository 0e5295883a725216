"""Checks and conventions every backend applies to an exec request the same way."""

from __future__ import annotations

import re
from collections.abc import Mapping

from sandbox.base import Command, SandboxLimits
from sandbox.workdir import relative_path

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ARGV_BYTES = 1_000_000
MAX_ENV_VARS = 256

# Where the work dir appears inside every backend.
WORKDIR = "/work"

# Variables every command starts with; the caller's ``env`` is applied on top.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}

# What common runtimes print when an allocation fails under an address-space rlimit.
_MEMORY_ERRORS = re.compile(
    rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|"
    rb"memory allocation of \d+ bytes failed|fatal error: runtime: out of memory"
)


def argv_of(cmd: Command) -> list[str]:
    """A string runs through ``/bin/sh -c``; a sequence is the argv itself."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("cmd is empty")
        argv = ["/bin/sh", "-c", cmd]
    else:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise ValueError("cmd must be a non-empty list of strings")
    if any("\0" in a for a in argv):
        raise ValueError("cmd must not contain NUL characters")
    if sum(len(a.encode()) for a in argv) > MAX_ARGV_BYTES:
        raise ValueError(f"cmd is over {MAX_ARGV_BYTES} bytes")
    return argv


def env_of(env: Mapping[str, str] | None) -> dict[str, str]:
    merged = dict(BASE_ENV)
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            raise ValueError(f"invalid environment variable name {key!r}")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"invalid value for environment variable {key}")
        merged[key] = value
    if len(merged) > MAX_ENV_VARS:
        raise ValueError(f"more than {MAX_ENV_VARS} environment variables")
    return merged


def cwd_of(cwd: str | None) -> str:
    """The in-sandbox directory for a work-dir-relative ``cwd``."""
    if cwd is None or cwd in ("", "."):
        return WORKDIR
    return f"{WORKDIR}/{relative_path(cwd)}"


def stdin_of(stdin: str | bytes | None) -> bytes | None:
    return stdin.encode() if isinstance(stdin, str) else stdin


def timeout_of(timeout_s: float | None, limits: SandboxLimits) -> float:
    """A per-call timeout may shorten the sandbox's wall-time limit, never extend it."""
    if timeout_s is None:
        return limits.wall_time_s
    if not timeout_s > 0:
        raise ValueError("timeout_s must be > 0")
    return min(float(timeout_s), limits.wall_time_s)


def looks_like_memory_error(stderr_tail: bytes) -> bool:
    return _MEMORY_ERRORS.search(stderr_tail) is not None


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
