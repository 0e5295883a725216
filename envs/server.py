"""Serve envs over HTTP and WebSocket with stateful sessions.

Routes (JSON bodies; errors answer ``{"detail": message, "code": CODE}``)::

    POST   /v1/sessions             {env?, seed?, options?} -> 201 {session_id, env, tools, result}
    POST   /v1/sessions/{id}/reset  {seed?, options?}       -> StepResult
    POST   /v1/sessions/{id}/step   {action, timeout_s?, request_id?} -> StepResult
    GET    /v1/sessions/{id}/state  -> {session_id, env, steps, state}
    DELETE /v1/sessions/{id}        -> 204
    GET    /v1/envs                 -> the envs this server serves
    GET    /healthz                 -> {status, sessions, max_sessions}

Status codes: 404 unknown env or session; 409 step after the episode ended; 422 a
malformed action or body; 503 at capacity; 504 a step past its timeout; 500 the env
raised. 504 and 500 also close the session (its env is in an unknown state). A
``request_id`` makes a retried step idempotent: the retry answers the first result.

OpenEnv compatibility (``openenv-core``'s ``EnvClient`` plays episodes over it):
``WS /ws`` with ``{"type": "reset|step|state|close", "data": ...}`` messages, one
session per connection (``?env=ID`` picks the env); and ``GET /health``, ``GET
/schema``, ``POST /reset``, ``POST /step``, ``GET /state``, which -- like OpenEnv's own
HTTP routes -- build a fresh env per request (``/step`` resets it first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from envs import registry
from envs.base import (
    ACTION_ADAPTER,
    Env,
    EnvCapacity,
    EnvConfigError,
    EnvError,
    InvalidAction,
    Observation,
    StepResult,
    parse_action,
)
from envs.sessions import EnvFactory, SessionManager


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionCreate(_Body):
    env: str | None = Field(default=None, description="env id; the server's default if empty")
    seed: int | None = None
    options: dict[str, Any] | None = None


class ResetBody(_Body):
    seed: int | None = None
    options: dict[str, Any] | None = None


class StepBody(_Body):
    action: dict[str, Any]
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    request_id: str | None = Field(default=None, min_length=1, max_length=200)


def _error(exc: EnvError) -> JSONResponse:
    return JSONResponse({"detail": exc.message, "code": exc.code}, status_code=exc.status_code)


def _json(result: StepResult) -> Response:
    # Serialised once by pydantic, not re-encoded by FastAPI: the hot path of the server.
    return Response(result.model_dump_json(), media_type="application/json")


def openenv_payload(result: StepResult) -> dict[str, Any]:
    """A StepResult in OpenEnv's ``{observation, reward, done}`` shape (plus our extras)."""
    return {
        "observation": result.observation.model_dump(mode="json"),
        "reward": result.reward,
        "done": result.done,
        "terminated": result.terminated,
        "truncated": result.truncated,
        "info": result.info,
    }


def create_app(
    factories: dict[str, EnvFactory],
    *,
    default_env: str | None = None,
    max_sessions: int = 1024,
    idle_ttl_s: float = 600.0,
    step_timeout_s: float = 60.0,
    thread_per_session: bool = False,
) -> FastAPI:
    """An app serving ``factories`` (env name -> zero-argument factory)."""
    if not factories:
        raise EnvConfigError("the server needs at least one env to serve")
    default = default_env or next(iter(factories))
    if default not in factories:
        raise EnvConfigError(f"default env {default!r} is not among the served envs")
    manager = SessionManager(
        factories,
        max_sessions=max_sessions,
        idle_ttl_s=idle_ttl_s,
        step_timeout_s=step_timeout_s,
        thread_per_session=thread_per_session,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager.start_reaper()
        try:
            yield
        finally:
            await manager.stop_reaper()
            await manager.close_all()

    app = FastAPI(title="AgentFlow env server", lifespan=lifespan)
    app.state.sessions = manager

    @app.exception_handler(EnvError)
    async def _env_error(request: Request, exc: EnvError) -> JSONResponse:
        return _error(exc)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(manager.sessions), "max_sessions": max_sessions}

    @app.get("/v1/envs")
    async def list_envs() -> dict[str, Any]:
        return {"default": default, "envs": sorted(factories)}

    @app.post("/v1/sessions", status_code=201)
    async def create_session(body: SessionCreate) -> dict[str, Any]:
        session = await manager.open(body.env or default)
        try:
            result = await manager.reset(session, body.seed, body.options)
        except EnvError:
            if session.id in manager.sessions:
                await manager.close(session.id)
            raise
        return {
            "session_id": session.id,
            "env": session.env_name,
            "tools": session.live_env.tools(),
            "result": result.model_dump(mode="json"),
        }

    @app.post("/v1/sessions/{session_id}/reset", response_model=StepResult)
    async def reset(session_id: str, body: ResetBody) -> Response:
        result = await manager.reset(manager.get(session_id), body.seed, body.options)
        return _json(result)

    @app.post("/v1/sessions/{session_id}/step", response_model=StepResult)
    async def step(session_id: str, body: StepBody) -> Response:
        session = manager.get(session_id)
        action = parse_action(body.action)
        result = await manager.step(session, action, body.timeout_s, body.request_id)
        return _json(result)

    @app.get("/v1/sessions/{session_id}/state")
    async def state(session_id: str) -> dict[str, Any]:
        session = manager.get(session_id)
        data = await manager.state(session)
        return {
            "session_id": session.id,
            "env": session.env_name,
            "steps": session.steps,
            "state": data,
        }

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete(session_id: str) -> Response:
        await manager.close(session_id)
        return Response(status_code=204)

    _add_openenv_routes(app, manager, default)
    return app


def _add_openenv_routes(app: FastAPI, manager: SessionManager, default: str) -> None:
    factory = manager.factories[default]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/schema")
    async def schema() -> dict[str, Any]:
        return {
            "action": ACTION_ADAPTER.json_schema(),
            "observation": Observation.model_json_schema(),
            "state": {"type": "object"},
        }

    async def one_shot(use: Callable[[Env], Any]) -> Any:
        if len(manager.sessions) >= manager.max_sessions:
            raise EnvCapacity("the server is at capacity")
        env = factory()
        try:
            return await use(env)
        finally:
            await env.close()

    @app.post("/reset")
    async def openenv_reset(body: dict[str, Any] | None = None) -> dict[str, Any]:
        body = body or {}

        async def use(env: Env) -> StepResult:
            return await env.reset(seed=body.get("seed"), options=body.get("options"))

        return openenv_payload(await one_shot(use))

    @app.post("/step")
    async def openenv_step(body: dict[str, Any]) -> dict[str, Any]:
        action = parse_action(body.get("action"))

        async def use(env: Env) -> StepResult:
            await env.reset(seed=body.get("seed"))
            return await env.step(action, timeout_s=body.get("timeout_s"))

        return openenv_payload(await one_shot(use))

    @app.get("/state")
    async def openenv_state() -> dict[str, Any]:
        async def use(env: Env) -> dict[str, Any]:
            return await env.state()

        return await one_shot(use)

    @app.websocket("/ws")
    async def websocket(ws: WebSocket) -> None:
        await ws.accept()
        env_name = ws.query_params.get("env") or default
        try:
            session = await manager.open(env_name)
        except EnvError as exc:
            code = "CAPACITY_REACHED" if isinstance(exc, EnvCapacity) else "SESSION_ERROR"
            # Answer the client's first message rather than racing it: a client that is
            # still sending would otherwise see a closed socket instead of the reason.
            with contextlib.suppress(WebSocketDisconnect, TimeoutError):
                await asyncio.wait_for(ws.receive_text(), timeout=10)
                await ws.send_json(
                    {"type": "error", "data": {"message": exc.message, "code": code}}
                )
                await ws.close()
            return
        try:
            await _serve_ws(ws, manager, session)
        except WebSocketDisconnect:
            pass
        finally:
            if session.id in manager.sessions:
                await manager.close(session.id)


async def _serve_ws(ws: WebSocket, manager: SessionManager, session: Any) -> None:
    while True:
        raw = await ws.receive_text()
        try:
            message = json.loads(raw)
        except json.JSONDecodeError as exc:
            await _ws_error(ws, f"Invalid JSON: {exc}", "INVALID_JSON")
            continue
        kind = message.get("type") if isinstance(message, dict) else None
        data = (message.get("data") or {}) if isinstance(message, dict) else {}
        try:
            if kind == "reset":
                result = await manager.reset(session, data.get("seed"), data.get("options"))
                await ws.send_json({"type": "observation", "data": openenv_payload(result)})
            elif kind == "step":
                action = parse_action(data)
                result = await manager.step(session, action, None, None)
                await ws.send_json({"type": "observation", "data": openenv_payload(result)})
            elif kind == "state":
                await ws.send_json({"type": "state", "data": await manager.state(session)})
            elif kind == "close":
                return
            else:
                await _ws_error(ws, f"Unknown message type: {kind}", "UNKNOWN_TYPE")
        except InvalidAction as exc:
            await _ws_error(ws, exc.message, "VALIDATION_ERROR")
        except EnvError as exc:
            await _ws_error(ws, exc.message, "EXECUTION_ERROR", exc.code)
            if session.closed:  # the env broke: its session is gone, and so is this socket
                await ws.close()
                return


async def _ws_error(ws: WebSocket, message: str, code: str, env_code: str | None = None) -> None:
    data = {"message": message, "code": code}
    if env_code:
        data["env_code"] = env_code
    await ws.send_json({"type": "error", "data": data})


def load_target(target: str) -> dict[str, EnvFactory]:
    """``target`` is a registered env id or ``module:Class`` named by the operator.

    A ``module:Class`` target is imported without the registry's allow-list: the person
    starting the server named that module, as with ``uvicorn module:app``.
    """
    if ":" not in target:
        registry.spec(target)
        return {target: lambda: registry.make(target)}
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvConfigError(f"{target!r} is not callable")
    factory: EnvFactory = obj
    return {target: factory}


def serve(target: str, host: str = "127.0.0.1", port: int = 8000, **opts: Any) -> None:
    """Serve ``target`` (a registered env id or ``module:Class``) until interrupted.

    ``opts``: ``max_sessions``, ``idle_ttl_s``, ``step_timeout_s``, ``thread_per_session``,
    and ``log_level`` for uvicorn.
    """
    import uvicorn

    log_level = opts.pop("log_level", "info")
    app = create_app(load_target(target), default_env=target, **opts)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m envs.server", description=serve.__doc__)
    parser.add_argument("target", help="registered env id or module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=1024)
    parser.add_argument("--idle-ttl-s", type=float, default=600.0)
    parser.add_argument("--step-timeout-s", type=float, default=60.0)
    parser.add_argument("--thread-per-session", action="store_true")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    serve(
        args.target,
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        idle_ttl_s=args.idle_ttl_s,
        step_timeout_s=args.step_timeout_s,
        thread_per_session=args.thread_per_session,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    # Run from the importable module, not this `__main__` copy: FastAPI resolves the
    # request models' annotations through the module that defines them.
    from envs.server import main as _main

    _main()
