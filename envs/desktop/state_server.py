"""The state server a desktop runs beside: OSWorld's VM server routes over its shell.

A remote desktop (envs/desktop/remote.py) is only as useful as the state access it
offers: task setup and checkers run commands and read files through these routes. This
app serves them for one desktop's :class:`DesktopShell` (a local desktop's, in
`agentflow desktop serve`), so a desktop container speaks the same protocol as an
OSWorld VM:

- `POST /execute` `{"command": str | [str], "shell": bool, "timeout": s}` ->
  `{"status", "output", "error", "returncode"}`: run in the desktop's session (its
  DISPLAY, its HOME as cwd, as the user the desktop runs as);
- `POST /file` form `file_path` -> the bytes (404 when missing);
- `POST /setup/upload` form `file_path` and file `file_data`;
- `POST /setup/launch` `{"command": str | [str], "shell": bool}`: start an app.

Paths are confined to the desktop's home (`~/x`, `x` or an absolute path inside it; a
path that leads out, `..` or a symlink included, is a 400). Every route but
`GET /health` needs `Authorization: Bearer <key>`: the routes are a shell on the
desktop, so a server without a key is refused unless the caller says it is for
development (:func:`create_app`).
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import FastAPI, Form, HTTPException, Response, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from envs.desktop.local import MAX_FILE_BYTES
from envs.desktop.provider import DesktopShell
from envs.desktop.remote import API_KEY_ENV
from sandbox.service import RequireApiKey

MAX_COMMAND_CHARS = 64 * 1024
# What is wrong with the desktop (its servers that exited), or None when it is well.
HealthProbe = Callable[[], Awaitable[str | None]]

Command = Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: Command
    shell: bool = False
    timeout: float = Field(default=10.0, gt=0, le=300)


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: Command
    shell: bool = False


def _argv(command: Command) -> list[str]:
    """A command as argv: a list as it is, a string split the way a shell would."""
    if isinstance(command, list):
        return command
    try:
        argv = shlex.split(command)
    except ValueError as exc:  # an unclosed quote
        raise HTTPException(400, f"command: {exc}") from None
    if not argv:
        raise HTTPException(400, "command: empty")
    return argv


def _script(command: Command, shell: bool) -> str:
    """The `sh -c` script for a command: a shell string as it is, argv quoted."""
    script = command if shell and isinstance(command, str) else shlex.join(_argv(command))
    if len(script) > MAX_COMMAND_CHARS:
        raise HTTPException(400, f"command: longer than {MAX_COMMAND_CHARS} characters")
    return script


def create_app(
    shell: DesktopShell,
    *,
    api_key: str | None,
    development: bool = False,
    health: HealthProbe | None = None,
) -> FastAPI:
    """The state server of the desktop behind `shell`.

    ``api_key`` empty or None is refused unless ``development`` is set: a keyless state
    server lets anyone who reaches its port run commands as the desktop's user.
    """
    if not api_key and not development:
        raise ValueError(f"the desktop state server needs an API key ({API_KEY_ENV})")
    app = FastAPI(title="AgentFlow desktop state server")
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)

    @app.get("/health", response_model=None)
    async def healthz() -> dict[str, str] | JSONResponse:
        problem = None if health is None else await health()
        if problem is not None:
            return JSONResponse({"status": "failing", "problem": problem}, status_code=503)
        return {"status": "ok"}

    @app.post("/execute")
    async def execute(body: ExecuteRequest) -> dict[str, object]:
        result = await shell.run(_script(body.command, body.shell), timeout_s=body.timeout)
        return {
            "status": "success" if result.ok else "error",
            "output": result.stdout,
            "error": result.stderr,
            "returncode": result.exit_code,
        }

    @app.post("/file")
    async def file(file_path: str = Form(min_length=1, max_length=4096)) -> Response:
        try:
            data = await shell.read_file(file_path)
        except ValueError as exc:  # outside the home
            raise HTTPException(400, str(exc)) from None
        if data is None:
            raise HTTPException(404, f"no file {file_path!r}")
        return Response(data, media_type="application/octet-stream")

    @app.post("/setup/upload")
    async def upload(
        file_data: UploadFile, file_path: str = Form(min_length=1, max_length=4096)
    ) -> dict[str, str]:
        data = await file_data.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise HTTPException(413, f"file_data: larger than {MAX_FILE_BYTES} bytes")
        try:
            await shell.write_file(file_path, data)
        except ValueError as exc:  # outside the home
            raise HTTPException(400, str(exc)) from None
        except OSError as exc:  # a directory in the way, say
            raise HTTPException(400, f"file_path: {exc.strerror or exc}") from None
        return {"status": "ok"}

    @app.post("/setup/launch")
    async def launch(body: LaunchRequest) -> dict[str, str]:
        argv = ["sh", "-c", _script(body.command, True)] if body.shell else _argv(body.command)
        try:
            await shell.launch(argv)
        except OSError as exc:  # no such program
            raise HTTPException(400, f"command: {exc.strerror or exc}: {argv[0]!r}") from None
        return {"status": "ok"}

    return app
