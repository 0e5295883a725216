"""`RemoteEnv`: the Env protocol over HTTP, against an env server (`envs/server.py`).

The first ``reset`` opens a session (``POST /v1/sessions``); later resets reuse it;
``close`` deletes it. Every request has an explicit timeout: ``connect_timeout_s`` to
connect, ``timeout_s`` for a reset or state, and a step's own ``timeout_s`` plus a margin
for the step itself. Transport errors, 502 and 503 are retried with back-off (a step is
retried with the same ``request_id``, so the server applies it once); other errors are
raised as the :mod:`envs.base` exception the server named, never retried. After a 500 or
504 the server has closed the session, so the next ``reset`` opens a new one.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import httpx

from envs import registry
from envs.base import (
    ERRORS_BY_CODE,
    Action,
    EnvClosed,
    EnvError,
    EpisodeFinished,
    StepResult,
    UnknownEnv,
)
from envs.specs import HttpEnvSpec

_RETRY_STATUS = frozenset({502, 503})
_STATUS_ERRORS: dict[int, type[EnvError]] = {
    404: UnknownEnv,
    409: EpisodeFinished,
    **{
        cls.status_code: cls
        for cls in ERRORS_BY_CODE.values()
        if cls.status_code in (422, 503, 504)
    },
}
# A step may take its whole timeout on the server; the response needs a little longer.
STEP_MARGIN_S = 5.0


def error_from_response(response: httpx.Response) -> EnvError:
    """The exception the server meant, from its status code and ``{detail, code}`` body."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    detail = body.get("detail") if isinstance(body, dict) else None
    code = body.get("code") if isinstance(body, dict) else None
    cls = ERRORS_BY_CODE.get(code or "") or _STATUS_ERRORS.get(response.status_code, EnvError)
    message = detail if isinstance(detail, str) else f"HTTP {response.status_code}: {detail}"
    return cls(message)


class RemoteEnv:
    """An env served by an env server at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        *,
        env: str | None = None,
        headers: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retries: int = 2,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.env = env
        self.options = dict(options or {})
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s)
        )
        self.session_id: str | None = None
        self._tools: list[dict[str, Any]] = []
        self._closed = False

    async def _request(
        self, method: str, path: str, *, json: Any = None, timeout_s: float | None = None
    ) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s or self.timeout_s, connect=self.connect_timeout_s)
        for attempt in range(self.retries + 1):
            try:
                response = await self._client.request(
                    method, self.base_url + path, json=json, timeout=timeout
                )
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise EnvError(f"env server unreachable: {type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code not in _RETRY_STATUS or attempt == self.retries:
                    if response.is_error:
                        error = error_from_response(response)
                        if response.status_code in (500, 504) and path.startswith(
                            f"/v1/sessions/{self.session_id}"
                        ):
                            self.session_id = None  # the server closed it
                        raise error
                    return response
            await asyncio.sleep(random.uniform(0.5, 1.0) * 0.1 * 2**attempt)  # jittered
        raise AssertionError("unreachable")

    def _check_open(self) -> None:
        if self._closed:
            raise EnvClosed("RemoteEnv is closed")

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        self._check_open()
        merged = {**self.options, **(options or {})} or None
        if self.session_id is None:
            body = {"env": self.env, "seed": seed, "options": merged}
            data = (await self._request("POST", "/v1/sessions", json=body)).json()
            self.session_id = data["session_id"]
            self._tools = data.get("tools", [])
            return StepResult.model_validate(data["result"])
        path = f"/v1/sessions/{self.session_id}/reset"
        response = await self._request("POST", path, json={"seed": seed, "options": merged})
        return StepResult.model_validate(response.json())

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        self._check_open()
        if self.session_id is None:
            raise EpisodeFinished("no open session: call reset first")
        body = {
            "action": action.model_dump(mode="json"),
            "timeout_s": timeout_s,
            "request_id": uuid.uuid4().hex,
        }
        wait = (timeout_s or self.timeout_s) + STEP_MARGIN_S
        path = f"/v1/sessions/{self.session_id}/step"
        response = await self._request("POST", path, json=body, timeout_s=wait)
        return StepResult.model_validate(response.json())

    async def state(self) -> dict[str, Any]:
        self._check_open()
        if self.session_id is None:
            return {"session_id": None}
        response = await self._request("GET", f"/v1/sessions/{self.session_id}/state")
        state: dict[str, Any] = response.json()["state"]
        return state

    def tools(self) -> list[dict[str, Any]]:
        """The tools the server announced when the session opened (empty before reset)."""
        return list(self._tools)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.session_id is not None:
                try:
                    await self._request("DELETE", f"/v1/sessions/{self.session_id}")
                except (UnknownEnv, EnvError):
                    pass  # already gone (reaped, or the server went away): nothing to free
                self.session_id = None
        finally:
            if self._own_client:
                await self._client.aclose()


def from_spec(spec: HttpEnvSpec) -> RemoteEnv:
    """The env a registered `http` spec describes: a client of its env server."""
    return RemoteEnv(str(spec.url), env=spec.env_id, headers=spec.headers, options=spec.options)


def register() -> None:
    """Register the `http` kind: envs served by an env server (`envs/server.py`)."""
    registry.register_kind("http", HttpEnvSpec, from_spec, replace=True)
