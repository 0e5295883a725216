"""``HttpSandbox``: the Sandbox protocol against the HTTP sandbox service.

The service runs each exec in a fresh sandbox, so this client carries the work dir: files
written here are sent with every exec, and the work dir the command leaves behind comes
back and replaces the local copy. Processes never outlive an exec (as with bwrap).
``stdin`` travels as JSON text, so bytes must be UTF-8.

It isolates whatever the service's backend isolates; the client itself runs nothing.
``api_key``: the key of a service started with one, sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import Mapping
from typing import Any

import httpx

from sandbox.base import (
    Command,
    ExecResult,
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
)
from sandbox.workdir import relative_path

# Transient answers worth one more try: a fresh sandbox per request makes exec repeatable.
_RETRY_STATUS = {502, 503, 504}


class HttpSandbox:
    def __init__(
        self,
        base_url: str,
        *,
        limits: SandboxLimits | None = None,
        network_timeout_s: float = 30.0,
        retries: int = 1,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.limits = limits
        self._retries = retries
        self._files: dict[str, bytes] = {}
        self._closed = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, transport=transport, timeout=network_timeout_s
        )

    async def exec(
        self,
        cmd: Command,
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        self._check_open()
        if isinstance(stdin, bytes):
            stdin = stdin.decode("utf-8", errors="strict")
        body: dict[str, Any] = {
            "cmd": cmd if isinstance(cmd, str) else list(cmd),
            "stdin": stdin,
            "files_b64": {p: base64.b64encode(d).decode() for p, d in self._files.items()},
            "env": dict(env or {}),
            "cwd": cwd,
            "timeout_s": timeout_s,
            "return_files": True,
        }
        if self.limits is not None:
            body["limits"] = self.limits.model_dump()
        wall = timeout_s or (self.limits.wall_time_s if self.limits else 3600)
        data = await self._post(body, read_timeout_s=wall + 30)
        if not data.get("files_truncated"):
            self._files = {p: base64.b64decode(b) for p, b in (data.get("files") or {}).items()}
        return ExecResult.model_validate(
            {k: v for k, v in data.items() if k in ExecResult.model_fields}
        )

    async def _post(self, body: dict[str, Any], read_timeout_s: float) -> dict[str, Any]:
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout_s)
        for attempt in range(self._retries + 1):
            try:
                resp = await self._http.post("/v1/exec", json=body, timeout=timeout)
            except httpx.TransportError as exc:
                if attempt < self._retries:
                    await asyncio.sleep(random.uniform(0.5, 1.0) * 0.2 * (attempt + 1))
                    continue
                raise SandboxError(f"sandbox service unreachable: {exc}") from exc
            if resp.status_code in _RETRY_STATUS and attempt < self._retries:
                await asyncio.sleep(random.uniform(0.5, 1.0) * 0.2 * (attempt + 1))
                continue
            if resp.status_code == 422:
                raise ValueError(f"sandbox service refused the request: {resp.text}")
            if resp.status_code != 200:
                raise SandboxError(f"sandbox service answered {resp.status_code}: {resp.text}")
            result: dict[str, Any] = resp.json()
            return result
        raise AssertionError("unreachable")

    async def write_file(self, path: str, data: str | bytes) -> None:
        self._check_open()
        self._files[str(relative_path(path))] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        key = str(relative_path(path))
        if key not in self._files:
            raise SandboxFileError(f"no such file in the work dir: {path!r}")
        return self._files[key]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("sandbox client is closed")
