"""An in-memory Sandbox for unit tests of the pool and the service (no isolation, no
processes): ``exec`` understands a tiny command language over its file dict."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from sandbox import ExecResult, ExecStatus, SandboxClosed, SandboxError, SandboxFileError
from sandbox.workdir import relative_path


class MemorySandbox:
    opened = 0

    def __init__(self, limits=None) -> None:
        MemorySandbox.opened += 1
        self.limits = limits
        self.files: dict[str, bytes] = {}
        self.closed = False
        self.resets = 0
        self.execs: list[dict] = []

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        if self.closed:
            raise SandboxClosed("closed")
        self.execs.append(
            {"cmd": cmd, "stdin": stdin, "cwd": cwd, "env": env, "timeout_s": timeout_s}
        )
        argv = cmd.split() if isinstance(cmd, str) else list(cmd)
        if argv[0] == "cat":
            out = b"".join(self.files[a] for a in argv[1:]).decode()
        elif argv[0] == "write":  # write PATH TEXT
            self.files[argv[1]] = argv[2].encode()
            out = ""
        elif argv[0] == "sleep":
            await asyncio.sleep(float(argv[1]))
            out = ""
        elif argv[0] == "explode":
            raise SandboxError("the sandbox broke")
        else:
            out = " ".join(argv)
        return ExecResult(
            stdout=out, stderr="", exit_code=0, status=ExecStatus.FINISHED, duration_s=0.0
        )

    async def write_file(self, path: str, data: str | bytes) -> None:
        self.files[str(relative_path(path))] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str) -> bytes:
        try:
            return self.files[str(relative_path(path))]
        except KeyError:
            raise SandboxFileError(path) from None

    async def list_files(self) -> list[str]:
        return sorted(self.files)

    async def reset(self) -> None:
        self.resets += 1
        self.files.clear()

    async def close(self) -> None:
        self.closed = True
