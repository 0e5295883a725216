"""A typed Python client for the AgentFlow REST API, sync (`Client`) and async (`AsyncClient`).

Each endpoint is described once as a `_Call` (method, path, body, how to read the answer);
the two clients only differ in how they send it. HTTP errors come back as the matching
class of `agentflow.errors`, so callers handle one exception tree on both sides of the wire.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

from agentflow.api.schemas.common import Page
from agentflow.api.schemas.envs import EnvCreate, EnvPublic, EnvUpdate
from agentflow.api.schemas.runs import EpisodePublic, RunPublic
from agentflow.errors import (
    AgentFlowError,
    CapacityExceeded,
    Conflict,
    EngineError,
    InvalidInput,
    NotFound,
    Unauthorized,
)
from agentflow.run_config import RunConfig

T = TypeVar("T")

_ERRORS: dict[int, type[AgentFlowError]] = {
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    502: EngineError,
    503: CapacityExceeded,
}


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)


def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    if response.status_code == 422 and isinstance(detail, list):
        first = detail[0] if detail else {}
        loc = tuple(str(p) for p in first.get("loc", ()))
        raise InvalidInput(f"{'.'.join(loc)}: {first.get('msg', detail)}", field=loc)
    cls = _ERRORS.get(response.status_code, AgentFlowError)
    raise cls(f"HTTP {response.status_code}: {detail}")


def _none(_: Any) -> None:
    return None


class _Endpoints:
    """The API, one method per endpoint, each returning a `_Call` to send."""

    @staticmethod
    def health() -> _Call[dict[str, Any]]:
        return _Call("GET", "/healthz", dict)

    @staticmethod
    def create_env(env: EnvCreate | dict[str, Any]) -> _Call[EnvPublic]:
        body = env.model_dump(mode="json") if isinstance(env, EnvCreate) else env
        return _Call("POST", "/v1/envs", EnvPublic.model_validate, json=body)

    @staticmethod
    def list_envs(
        name: str | None = None, kind: str | None = None, limit: int = 50, offset: int = 0
    ) -> _Call[Page[EnvPublic]]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        params |= {k: v for k, v in {"name": name, "kind": kind}.items() if v is not None}
        return _Call("GET", "/v1/envs", Page[EnvPublic].model_validate, params=params)

    @staticmethod
    def get_env(env_id: uuid.UUID | str) -> _Call[EnvPublic]:
        return _Call("GET", f"/v1/envs/{env_id}", EnvPublic.model_validate)

    @staticmethod
    def update_env(env_id: uuid.UUID | str, update: EnvUpdate | dict[str, Any]) -> _Call[EnvPublic]:
        body = (
            update.model_dump(mode="json", exclude_unset=True)
            if isinstance(update, EnvUpdate)
            else update
        )
        return _Call("PATCH", f"/v1/envs/{env_id}", EnvPublic.model_validate, json=body)

    @staticmethod
    def delete_env(env_id: uuid.UUID | str) -> _Call[None]:
        return _Call("DELETE", f"/v1/envs/{env_id}", _none)

    @staticmethod
    def create_run(config: RunConfig | dict[str, Any], start: bool = True) -> _Call[RunPublic]:
        body = config.model_dump(mode="json") if isinstance(config, RunConfig) else config
        params = {"start": str(start).lower()}
        return _Call("POST", "/v1/runs", RunPublic.model_validate, json=body, params=params)

    @staticmethod
    def list_run_episodes(
        run_id: uuid.UUID | str, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> _Call[Page[EpisodePublic]]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status is not None:
            params["status"] = status
        parse = Page[EpisodePublic].model_validate
        return _Call("GET", f"/v1/runs/{run_id}/episodes", parse, params=params)

    @staticmethod
    def control_run(run_id: uuid.UUID | str, action: str) -> _Call[RunPublic]:
        if action not in ("pause", "resume", "stop"):
            raise ValueError(f"unknown run action {action!r}")
        return _Call("POST", f"/v1/runs/{run_id}/{action}", RunPublic.model_validate)

    @staticmethod
    def list_runs(
        status: str | None = None, limit: int = 50, offset: int = 0, name: str | None = None
    ) -> _Call[Page[RunPublic]]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        params |= {k: v for k, v in {"status": status, "name": name}.items() if v is not None}
        return _Call("GET", "/v1/runs", Page[RunPublic].model_validate, params=params)

    @staticmethod
    def get_run(run_id: uuid.UUID | str) -> _Call[RunPublic]:
        return _Call("GET", f"/v1/runs/{run_id}", RunPublic.model_validate)

    @staticmethod
    def get_episode(episode_id: uuid.UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/v1/episodes/{episode_id}", dict)

    @staticmethod
    def get_trajectory(trajectory_id: uuid.UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/v1/trajectories/{trajectory_id}", dict)

    @staticmethod
    def update_weights(run_id: uuid.UUID | str, version: int, path: str) -> _Call[int]:
        body = {"version": version, "path": path}
        return _Call("POST", f"/v1/runs/{run_id}/weights", lambda r: int(r["version"]), json=body)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client:
    """Blocking client: `Client(url, api_key=...)`, one method per endpoint."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    def _send(self, call: _Call[T]) -> T:
        response = self._http.request(
            call.method, call.path, json=call.json, params=call.params or None
        )
        _raise_for_status(response)
        return call.parse(response.json() if response.content else None)

    def health(self) -> dict[str, Any]:
        return self._send(_Endpoints.health())

    def create_env(self, env: EnvCreate | dict[str, Any]) -> EnvPublic:
        return self._send(_Endpoints.create_env(env))

    def list_envs(
        self, name: str | None = None, kind: str | None = None, limit: int = 50, offset: int = 0
    ) -> Page[EnvPublic]:
        return self._send(_Endpoints.list_envs(name, kind, limit, offset))

    def get_env(self, env_id: uuid.UUID | str) -> EnvPublic:
        return self._send(_Endpoints.get_env(env_id))

    def update_env(self, env_id: uuid.UUID | str, update: EnvUpdate | dict[str, Any]) -> EnvPublic:
        return self._send(_Endpoints.update_env(env_id, update))

    def delete_env(self, env_id: uuid.UUID | str) -> None:
        return self._send(_Endpoints.delete_env(env_id))

    def create_run(self, config: RunConfig | dict[str, Any], start: bool = True) -> RunPublic:
        return self._send(_Endpoints.create_run(config, start))

    def list_run_episodes(
        self, run_id: uuid.UUID | str, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[EpisodePublic]:
        return self._send(_Endpoints.list_run_episodes(run_id, status, limit, offset))

    def pause_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return self._send(_Endpoints.control_run(run_id, "pause"))

    def resume_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return self._send(_Endpoints.control_run(run_id, "resume"))

    def stop_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return self._send(_Endpoints.control_run(run_id, "stop"))

    def list_runs(
        self, status: str | None = None, limit: int = 50, offset: int = 0, name: str | None = None
    ) -> Page[RunPublic]:
        return self._send(_Endpoints.list_runs(status, limit, offset, name))

    def get_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return self._send(_Endpoints.get_run(run_id))

    def get_episode(self, episode_id: uuid.UUID | str) -> dict[str, Any]:
        return self._send(_Endpoints.get_episode(episode_id))

    def get_trajectory(self, trajectory_id: uuid.UUID | str) -> dict[str, Any]:
        return self._send(_Endpoints.get_trajectory(trajectory_id))

    def update_weights(self, run_id: uuid.UUID | str, version: int, path: str) -> int:
        """Switch a live run's engines to the weights directory `path` as `version`."""
        return self._send(_Endpoints.update_weights(run_id, version, path))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient:
    """The same endpoints as `Client`, awaited."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    async def _send(self, call: _Call[T]) -> T:
        response = await self._http.request(
            call.method, call.path, json=call.json, params=call.params or None
        )
        _raise_for_status(response)
        return call.parse(response.json() if response.content else None)

    async def health(self) -> dict[str, Any]:
        return await self._send(_Endpoints.health())

    async def create_env(self, env: EnvCreate | dict[str, Any]) -> EnvPublic:
        return await self._send(_Endpoints.create_env(env))

    async def list_envs(
        self, name: str | None = None, kind: str | None = None, limit: int = 50, offset: int = 0
    ) -> Page[EnvPublic]:
        return await self._send(_Endpoints.list_envs(name, kind, limit, offset))

    async def get_env(self, env_id: uuid.UUID | str) -> EnvPublic:
        return await self._send(_Endpoints.get_env(env_id))

    async def update_env(
        self, env_id: uuid.UUID | str, update: EnvUpdate | dict[str, Any]
    ) -> EnvPublic:
        return await self._send(_Endpoints.update_env(env_id, update))

    async def delete_env(self, env_id: uuid.UUID | str) -> None:
        return await self._send(_Endpoints.delete_env(env_id))

    async def create_run(self, config: RunConfig | dict[str, Any], start: bool = True) -> RunPublic:
        return await self._send(_Endpoints.create_run(config, start))

    async def list_run_episodes(
        self, run_id: uuid.UUID | str, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> Page[EpisodePublic]:
        return await self._send(_Endpoints.list_run_episodes(run_id, status, limit, offset))

    async def pause_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return await self._send(_Endpoints.control_run(run_id, "pause"))

    async def resume_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return await self._send(_Endpoints.control_run(run_id, "resume"))

    async def stop_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return await self._send(_Endpoints.control_run(run_id, "stop"))

    async def list_runs(
        self, status: str | None = None, limit: int = 50, offset: int = 0, name: str | None = None
    ) -> Page[RunPublic]:
        return await self._send(_Endpoints.list_runs(status, limit, offset, name))

    async def get_run(self, run_id: uuid.UUID | str) -> RunPublic:
        return await self._send(_Endpoints.get_run(run_id))

    async def get_episode(self, episode_id: uuid.UUID | str) -> dict[str, Any]:
        return await self._send(_Endpoints.get_episode(episode_id))

    async def get_trajectory(self, trajectory_id: uuid.UUID | str) -> dict[str, Any]:
        return await self._send(_Endpoints.get_trajectory(trajectory_id))

    async def update_weights(self, run_id: uuid.UUID | str, version: int, path: str) -> int:
        return await self._send(_Endpoints.update_weights(run_id, version, path))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
