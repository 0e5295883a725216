"""The HTTP sandbox service: run one command in a fresh sandbox per request.

``POST /v1/exec`` takes ``{cmd, stdin, files, files_b64, env, cwd, timeout_s, limits,
return_files}``, runs ``cmd`` in a one-shot sandbox taken from a warm pool (or a fresh
one when the request asks for its own limits), and answers an :class:`ExecResult`, plus
the work dir's files when ``return_files`` is set. Bad input is a 422; limits above the
service's maximum are a 422; a sandbox that fails is a 503 for that request only.
``GET /health`` reports the pool.

With an API key (``create_app(api_key=...)``, ``--api-key``), every request but
``GET /health`` must carry ``Authorization: Bearer <key>``; one without it, or with
another key, is a 401 before anything of the request is read, so a caller without the
key learns nothing about the routes or their schemas.

Run it with ``python -m sandbox.service --port 8300``. Each option also has an environment
variable, for a container configured from its environment (the flag wins):
``AGENTFLOW_SANDBOX_HOST``, ``AGENTFLOW_SANDBOX_PORT``, ``AGENTFLOW_SANDBOX_BACKEND``,
``AGENTFLOW_SANDBOX_POOL_SIZE``, ``AGENTFLOW_SANDBOX_API_KEY`` (empty: no key).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import Base64Bytes, BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sandbox import BACKENDS, open_sandbox
from sandbox.base import ExecResult, Sandbox, SandboxError, SandboxFileError, SandboxLimits
from sandbox.commands import ENV_NAME
from sandbox.pool import SandboxPool
from sandbox.workdir import relative_path

log = logging.getLogger(__name__)

MAX_REQUEST_FILES = 1000
MAX_REQUEST_FILE_BYTES = 32 * 1024 * 1024  # sum over the request's files
MAX_RETURNED_FILE_BYTES = 32 * 1024 * 1024

SandboxFactory = Callable[[SandboxLimits], Sandbox]


def _check_path(path: str) -> None:
    try:
        relative_path(path)
    except SandboxFileError as exc:  # pydantic turns ValueError into a 422
        raise ValueError(str(exc)) from exc


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[str, Field(min_length=1)]
    )
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="path -> UTF-8 text")
    files_b64: dict[str, Base64Bytes] = Field(default_factory=dict, description="path -> bytes")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    limits: SandboxLimits | None = None
    return_files: bool = Field(default=False, description="Answer the work dir's files too.")

    @field_validator("files", "files_b64")
    @classmethod
    def _paths_inside_work_dir(cls, files: dict[str, Any]) -> dict[str, Any]:
        if len(files) > MAX_REQUEST_FILES:
            raise ValueError(f"at most {MAX_REQUEST_FILES} files")
        for path in files:
            _check_path(path)
        total = sum(len(v) for v in files.values())
        if total > MAX_REQUEST_FILE_BYTES:
            raise ValueError(f"files total {total} bytes, over {MAX_REQUEST_FILE_BYTES}")
        return files

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not ENV_NAME.match(k)] + [k for k, v in env.items() if "\0" in v]
        if bad:
            raise ValueError(f"invalid environment variables: {bad}")
        return env

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, cwd: str | None) -> str | None:
        if cwd is not None and cwd not in ("", "."):
            _check_path(cwd)
        return cwd


class ExecResponse(ExecResult):
    files: dict[str, str] | None = Field(default=None, description="path -> base64, if asked")
    files_truncated: bool = False


def _within(limits: SandboxLimits, ceiling: SandboxLimits) -> list[str]:
    return [name for name, value in limits.model_dump().items() if value > getattr(ceiling, name)]


async def _collect_files(sandbox: Sandbox) -> tuple[dict[str, str], bool]:
    lister = getattr(sandbox, "list_files", None)
    if lister is None:
        return {}, True  # this backend cannot enumerate its work dir
    files: dict[str, str] = {}
    total = 0
    for path in await lister():
        data = await sandbox.read_file(path)
        total += len(data)
        if total > MAX_RETURNED_FILE_BYTES:
            return files, True
        files[path] = base64.b64encode(data).decode()
    return files, False


def key_problem(authorization: bytes | None, api_key: str) -> str | None:
    """Why an ``Authorization`` header (its raw value) does not carry ``api_key``, or None."""
    scheme, _, token = (authorization or b"").partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return "missing API key: send `Authorization: Bearer <key>`"
    # The header's raw bytes against the key's UTF-8 bytes: compare_digest refuses str with
    # non-ASCII characters, and the raw bytes need no guess at the header's encoding.
    if not hmac.compare_digest(token, api_key.encode()):
        return "wrong API key"
    return None


class RequireApiKey:
    """ASGI middleware: a 401 for any request but ``GET /health`` without the key.

    A middleware rather than a route dependency: FastAPI solves dependencies and the body
    together, so a request with neither key nor valid body would get the body's 422 (and
    learn the schema) instead of the 401. Here the key is checked before routing, so an
    unknown path is a 401 too, not a 404.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        # A key with edge whitespace could never match: the token is read stripped.
        if not api_key or api_key != api_key.strip():
            raise ValueError("the API key must be non-empty, without edge whitespace")
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] == "/health"):
            await self.app(scope, receive, send)  # lifespan events, and the health check
            return
        authorization = next(
            (value for name, value in scope["headers"] if name.lower() == b"authorization"), None
        )
        problem = key_problem(authorization, self.api_key)
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {"detail": problem}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


def create_app(
    factory: SandboxFactory | None = None,
    *,
    backend: str = "bwrap",
    default_limits: SandboxLimits | None = None,
    max_limits: SandboxLimits | None = None,
    pool_size: int = 2,
    max_active: int = 8,
    api_key: str | None = None,
    image: str | None = None,
) -> FastAPI:
    """The service app; ``factory(limits)`` opens a sandbox (default: ``open_sandbox``).

    ``image``: the docker backend's image (its default otherwise); bwrap takes none.

    ``api_key``: when set (not empty), every route but ``GET /health`` needs
    ``Authorization: Bearer <api_key>``.
    """
    if image is not None and backend != "docker":
        raise ValueError(f"an image is for the docker backend, not {backend!r}")
    options: dict[str, Any] = {"image": image} if image is not None else {}
    make: SandboxFactory = factory or (
        lambda limits: open_sandbox(backend, limits=limits, **options)
    )
    defaults = default_limits or SandboxLimits()
    ceiling = max_limits or SandboxLimits(
        wall_time_s=60, cpu_time_s=60, memory_mb=2048, max_processes=256
    )
    if _within(defaults, ceiling):
        raise ValueError("default_limits exceed max_limits")
    pool = SandboxPool(lambda: make(defaults), size=pool_size, max_active=max_active)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="AgentFlow sandbox service", lifespan=lifespan)
    app.state.pool = pool
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "backend": backend, "idle": pool.idle, "active": pool.active}

    @app.post("/v1/exec", response_model=ExecResponse)
    async def exec_command(req: ExecRequest, request: Request) -> ExecResponse:
        limits = req.limits or defaults
        over = _within(limits, ceiling)
        if over:
            raise HTTPException(422, f"limits above this service's maximum: {over}")
        try:
            if req.limits is None or req.limits == defaults:
                async with pool.acquire() as sandbox:
                    return await _run(sandbox, req)
            sandbox = make(limits)
            try:
                return await _run(sandbox, req)
            finally:
                await sandbox.close()
        except (ValueError, SandboxFileError) as exc:
            raise HTTPException(422, str(exc)) from exc
        except SandboxError as exc:
            log.warning("sandbox failed: %s", exc)
            raise HTTPException(503, f"sandbox failed: {exc}") from exc

    return app


async def _run(sandbox: Sandbox, req: ExecRequest) -> ExecResponse:
    for path, text in req.files.items():
        await sandbox.write_file(path, text)
    for path, data in req.files_b64.items():
        await sandbox.write_file(path, data)
    result = await sandbox.exec(
        req.cmd, stdin=req.stdin, cwd=req.cwd, env=req.env, timeout_s=req.timeout_s
    )
    files, truncated = await _collect_files(sandbox) if req.return_files else (None, False)
    return ExecResponse(**result.model_dump(), files=files, files_truncated=truncated)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox.service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    # A default from the environment is a string; argparse runs `type` on string defaults
    # too, so a bad AGENTFLOW_SANDBOX_PORT fails like a bad --port.
    parser.add_argument("--host", default=env("AGENTFLOW_SANDBOX_HOST") or "127.0.0.1")
    parser.add_argument("--port", type=int, default=env("AGENTFLOW_SANDBOX_PORT") or 8300)
    parser.add_argument("--backend", choices=BACKENDS, default=env("AGENTFLOW_SANDBOX_BACKEND"))
    parser.add_argument("--pool-size", type=int, default=env("AGENTFLOW_SANDBOX_POOL_SIZE") or 2)
    parser.add_argument("--max-active", type=int, default=8)
    parser.add_argument(
        "--api-key",
        default=env("AGENTFLOW_SANDBOX_API_KEY", ""),
        help="require `Authorization: Bearer <key>` on every route but GET /health (empty: no key)",
    )
    parser.add_argument(
        "--image",
        default=env("AGENTFLOW_SANDBOX_IMAGE") or None,
        help="the docker backend's image (commands run in it)",
    )
    args = parser.parse_args(argv)
    # argparse checks `choices` against the command line only, not against a default.
    backend = args.backend or "bwrap"
    if backend not in BACKENDS:
        parser.error(f"AGENTFLOW_SANDBOX_BACKEND={backend!r}: expected one of {BACKENDS}")
    if args.image is not None and backend != "docker":
        parser.error(f"--image (AGENTFLOW_SANDBOX_IMAGE) is for the docker backend, not {backend}")
    import uvicorn

    app = create_app(
        backend=backend,
        pool_size=args.pool_size,
        max_active=args.max_active,
        api_key=args.api_key.strip() or None,  # a key file's trailing newline is no part of it
        image=args.image,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
