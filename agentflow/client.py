"""A typed Python client for the AgentFlow REST API, sync (`Client`) and async (`AsyncClient`).

Each endpoint is described once as a `_Call` (method, path, body, how to read the answer);
the two clients only differ in how they send it. HTTP errors come back as the matching
class of `agentflow.errors`, so callers handle one exception tree on both sides of the wire.

`RetryingTransport` makes either client (or a plain `httpx.AsyncClient`) ride out a
gateway that went away or hangs: it gives each attempt a deadline, resends on transport
errors, missed deadlines and 502/503/504 answers, with full-jitter exponential backoff,
for a `RetryPolicy` window; then `GatewayUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
import orjson
import tenacity

from agentflow.api.schemas.common import Page
from agentflow.api.schemas.envs import EnvCreate, EnvPublic, EnvUpdate
from agentflow.api.schemas.runs import EpisodePublic, RunDetail, RunPublic
from agentflow.errors import (
    AgentFlowError,
    CapacityExceeded,
    Conflict,
    EngineError,
    InvalidInput,
    NotFound,
    Unauthorized,
)
from agentflow.inference.base import BroadcastWeights, WeightGroup
from agentflow.run_config import EnvMixChange, RunConfig
from agentflow.types import Trajectory

T = TypeVar("T")

log = logging.getLogger(__name__)

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
    text: bool = False  # the answer is text (Prometheus), not JSON

    def answer(self, response: httpx.Response) -> T:
        if self.text:
            return self.parse(response.text)
        return self.parse(orjson.loads(response.content) if response.content else None)


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


def _trajectories(answer: Any) -> list[Trajectory]:
    from agentflow.rollout.stream import trajectory_from_json

    return [trajectory_from_json(t) for t in answer["trajectories"]]


class _Endpoints:
    """The API, one method per endpoint, each returning a `_Call` to send."""

    @staticmethod
    def live() -> _Call[dict[str, Any]]:
        return _Call("GET", "/livez", dict)

    @staticmethod
    def health() -> _Call[dict[str, Any]]:
        return _Call("GET", "/readyz", dict)

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
    def get_run(run_id: uuid.UUID | str) -> _Call[RunDetail]:
        return _Call("GET", f"/v1/runs/{run_id}", RunDetail.model_validate)

    @staticmethod
    def change_run_envs(
        run_id: uuid.UUID | str, change: EnvMixChange | dict[str, Any]
    ) -> _Call[RunDetail]:
        body = (
            change.model_dump(mode="json", exclude_none=True)
            if isinstance(change, EnvMixChange)
            else change
        )
        return _Call("PATCH", f"/v1/runs/{run_id}", RunDetail.model_validate, json=body)

    @staticmethod
    def get_episode(episode_id: uuid.UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/v1/episodes/{episode_id}", dict)

    @staticmethod
    def get_trajectory(trajectory_id: uuid.UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/v1/trajectories/{trajectory_id}", dict)

    @staticmethod
    def update_weights(
        run_id: uuid.UUID | str,
        version: int,
        path: str | None = None,
        broadcast: BroadcastWeights | None = None,
    ) -> _Call[int]:
        body: dict[str, Any] = {"version": version}
        if path is not None:
            body["path"] = path
        if broadcast is not None:
            body["broadcast"] = broadcast.model_dump()
        return _Call("POST", f"/v1/runs/{run_id}/weights", lambda r: int(r["version"]), json=body)

    @staticmethod
    def weight_group_ranks(run_id: uuid.UUID | str) -> _Call[int]:
        return _Call("GET", f"/v1/runs/{run_id}/weights/group", lambda r: int(r["ranks"]))

    @staticmethod
    def join_weight_group(run_id: uuid.UUID | str, group: WeightGroup) -> _Call[None]:
        return _Call(
            "POST", f"/v1/runs/{run_id}/weights/group", lambda r: None, json=group.model_dump()
        )

    @staticmethod
    def run_metrics(run_id: uuid.UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/v1/runs/{run_id}/metrics", dict)

    @staticmethod
    def record_metrics(
        run_id: uuid.UUID | str, version: int, metrics: dict[str, float], step: int | None
    ) -> _Call[None]:
        body: dict[str, Any] = {"version": version, "metrics": metrics}
        if step is not None:
            body["step"] = step
        return _Call("POST", f"/v1/runs/{run_id}/metrics", _none, json=body)

    @staticmethod
    def lease(
        run_id: uuid.UUID | str, max_n: int, timeout_s: float = 0.0, lease_id: str | None = None
    ) -> _Call[list[Trajectory]]:
        body = {"max_n": max_n, "timeout_s": timeout_s, "lease_id": lease_id}
        return _Call(
            "POST",
            f"/v1/runs/{run_id}/trajectories/lease",
            _trajectories,
            json=body,
        )

    @staticmethod
    def ack(
        run_id: uuid.UUID | str, ids: list[uuid.UUID] | list[str], lease_id: str | None = None
    ) -> _Call[int]:
        body = {"ids": [str(i) for i in ids], "lease_id": lease_id}
        path = f"/v1/runs/{run_id}/trajectories/ack"
        return _Call("POST", path, lambda r: int(r["acked"]), json=body)

    @staticmethod
    def reject(
        run_id: uuid.UUID | str, trajectory_id: uuid.UUID | str, error: str, lease_id: str | None
    ) -> _Call[None]:
        body = {"id": str(trajectory_id), "lease_id": lease_id, "error": error}
        return _Call("POST", f"/v1/runs/{run_id}/trajectories/reject", _none, json=body)

    @staticmethod
    def reclaim(run_id: uuid.UUID | str) -> _Call[int]:
        path = f"/v1/runs/{run_id}/trajectories/reclaim"
        return _Call("POST", path, lambda r: int(r["reclaimed"]))

    @staticmethod
    def list_models() -> _Call[list[str]]:
        return _Call("GET", "/v1/models", lambda r: [m["id"] for m in r["data"]])

    @staticmethod
    def prometheus_metrics() -> _Call[str]:
        return _Call("GET", "/metrics", str, text=True)


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
        return call.answer(response)

    def live(self) -> dict[str, Any]:
        """`/livez`: the gateway process answers (the database is not asked)."""
        return self._send(_Endpoints.live())

    def health(self) -> dict[str, Any]:
        """`/readyz`: the gateway can serve requests; its database answers."""
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

    def get_run(self, run_id: uuid.UUID | str) -> RunDetail:
        """The run, with its env mix now and the mix's revisions."""
        return self._send(_Endpoints.get_run(run_id))

    def change_run_envs(
        self, run_id: uuid.UUID | str, change: EnvMixChange | dict[str, Any]
    ) -> RunDetail:
        """Change a live run's env mix (`PATCH /v1/runs/{id}`, docs/runs.md)."""
        return self._send(_Endpoints.change_run_envs(run_id, change))

    def get_episode(self, episode_id: uuid.UUID | str) -> dict[str, Any]:
        return self._send(_Endpoints.get_episode(episode_id))

    def get_trajectory(self, trajectory_id: uuid.UUID | str) -> dict[str, Any]:
        return self._send(_Endpoints.get_trajectory(trajectory_id))

    def update_weights(self, run_id: uuid.UUID | str, version: int, path: str) -> int:
        """Switch a live run's engines to the weights directory `path` as `version`."""
        return self._send(_Endpoints.update_weights(run_id, version, path))

    def run_metrics(self, run_id: uuid.UUID | str) -> dict[str, Any]:
        """The trainer's metrics per weight version."""
        return self._send(_Endpoints.run_metrics(run_id))

    def record_metrics(
        self,
        run_id: uuid.UUID | str,
        version: int,
        metrics: dict[str, float],
        step: int | None = None,
    ) -> None:
        """A trainer step's metrics, attached to the version it produced (split form).
        With `step`, they replace any recorded for that step, or a later one, at an older
        version (steps a trainer did again after resuming from a checkpoint)."""
        return self._send(_Endpoints.record_metrics(run_id, version, metrics, step))

    def lease(
        self,
        run_id: uuid.UUID | str,
        max_n: int,
        timeout_s: float = 0.0,
        lease_id: str | None = None,
    ) -> list[Trajectory]:
        """Up to `max_n` trajectories from the run's stream (docs/async-rollout.md)."""
        return self._send(_Endpoints.lease(run_id, max_n, timeout_s, lease_id))

    def ack(
        self, run_id: uuid.UUID | str, ids: list[uuid.UUID] | list[str], lease_id: str | None = None
    ) -> int:
        return self._send(_Endpoints.ack(run_id, ids, lease_id))

    def reject(
        self,
        run_id: uuid.UUID | str,
        trajectory_id: uuid.UUID | str,
        error: str,
        lease_id: str | None = None,
    ) -> None:
        return self._send(_Endpoints.reject(run_id, trajectory_id, error, lease_id))

    def reclaim(self, run_id: uuid.UUID | str) -> int:
        return self._send(_Endpoints.reclaim(run_id))

    def list_models(self) -> list[str]:
        """The models the live runs serve (`GET /v1/models`)."""
        return self._send(_Endpoints.list_models())

    def prometheus_metrics(self) -> str:
        """`/metrics`, Prometheus text."""
        return self._send(_Endpoints.prometheus_metrics())

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
        return call.answer(response)

    async def live(self) -> dict[str, Any]:
        """`/livez`: the gateway process answers (the database is not asked)."""
        return await self._send(_Endpoints.live())

    async def health(self) -> dict[str, Any]:
        """`/readyz`: the gateway can serve requests; its database answers."""
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

    async def get_run(self, run_id: uuid.UUID | str) -> RunDetail:
        """The run, with its env mix now and the mix's revisions."""
        return await self._send(_Endpoints.get_run(run_id))

    async def change_run_envs(
        self, run_id: uuid.UUID | str, change: EnvMixChange | dict[str, Any]
    ) -> RunDetail:
        """Change a live run's env mix (`PATCH /v1/runs/{id}`, docs/runs.md)."""
        return await self._send(_Endpoints.change_run_envs(run_id, change))

    async def get_episode(self, episode_id: uuid.UUID | str) -> dict[str, Any]:
        return await self._send(_Endpoints.get_episode(episode_id))

    async def get_trajectory(self, trajectory_id: uuid.UUID | str) -> dict[str, Any]:
        return await self._send(_Endpoints.get_trajectory(trajectory_id))

    async def update_weights(
        self,
        run_id: uuid.UUID | str,
        version: int,
        path: str | None = None,
        *,
        broadcast: BroadcastWeights | None = None,
    ) -> int:
        """Switch a live run's engines to `version`: the weights directory `path`, or the
        buckets being broadcast over the run's weight group."""
        return await self._send(_Endpoints.update_weights(run_id, version, path, broadcast))

    async def weight_group_ranks(self, run_id: uuid.UUID | str) -> int:
        """How many ranks the run's engines bring to a trainer's weight group."""
        return await self._send(_Endpoints.weight_group_ranks(run_id))

    async def join_weight_group(self, run_id: uuid.UUID | str, group: WeightGroup) -> None:
        """Have the run's engines join `group`; answers once the trainer has joined too."""
        return await self._send(_Endpoints.join_weight_group(run_id, group))

    async def run_metrics(self, run_id: uuid.UUID | str) -> dict[str, Any]:
        """The trainer's metrics per weight version."""
        return await self._send(_Endpoints.run_metrics(run_id))

    async def record_metrics(
        self,
        run_id: uuid.UUID | str,
        version: int,
        metrics: dict[str, float],
        step: int | None = None,
    ) -> None:
        """A trainer step's metrics, attached to the version it produced (split form).
        With `step`, they replace any recorded for that step, or a later one, at an older
        version (steps a trainer did again after resuming from a checkpoint)."""
        return await self._send(_Endpoints.record_metrics(run_id, version, metrics, step))

    async def lease(
        self,
        run_id: uuid.UUID | str,
        max_n: int,
        timeout_s: float = 0.0,
        lease_id: str | None = None,
    ) -> list[Trajectory]:
        """Up to `max_n` trajectories from the run's stream (docs/async-rollout.md)."""
        return await self._send(_Endpoints.lease(run_id, max_n, timeout_s, lease_id))

    async def ack(
        self, run_id: uuid.UUID | str, ids: list[uuid.UUID] | list[str], lease_id: str | None = None
    ) -> int:
        return await self._send(_Endpoints.ack(run_id, ids, lease_id))

    async def reject(
        self,
        run_id: uuid.UUID | str,
        trajectory_id: uuid.UUID | str,
        error: str,
        lease_id: str | None = None,
    ) -> None:
        return await self._send(_Endpoints.reject(run_id, trajectory_id, error, lease_id))

    async def reclaim(self, run_id: uuid.UUID | str) -> int:
        return await self._send(_Endpoints.reclaim(run_id))

    async def list_models(self) -> list[str]:
        """The models the live runs serve (`GET /v1/models`)."""
        return await self._send(_Endpoints.list_models())

    async def prometheus_metrics(self) -> str:
        """`/metrics`, Prometheus text."""
        return await self._send(_Endpoints.prometheus_metrics())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


# ---- retries ------------------------------------------------------------------------

# Answers a gateway gives while it restarts or an upstream is down; any other status is
# the caller's to see at once (a 4xx is never retried: sending it again changes nothing).
RETRY_STATUSES = frozenset({502, 503, 504})
# Transport errors a gateway coming back can mend. Not UnsupportedProtocol, ProxyError or
# LocalProtocolError: those are this side's mistakes.
_TRANSIENT = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


class GatewayUnavailable(AgentFlowError):
    """The gateway gave no usable answer to a call for a whole retry window."""

    status_code = 503


@dataclass(frozen=True)
class RetryPolicy:
    """How long, and how often, a call to a gateway that went away is sent again.

    The wait before retry n is drawn uniformly from [0, min(max_wait_s, first_wait_s *
    2**(n-1))] ("full jitter": trainers that lost one gateway do not come back in step).
    A call is retried until `window_s` seconds after its first failed attempt was sent.

    Each attempt, from connecting to the answer's last byte, has `attempt_timeout_s`
    (default: 60 s, or half the window when that is shorter); one that runs out is a
    failure like a refused connection. A gateway that hangs (it accepts the connection,
    or the request, and never answers) is so retried like one that died, instead of
    holding the call for as long as the client's own timeout. It must be shorter than
    the window, else one hung attempt would outlast the window before a retry could run.
    """

    window_s: float = 300.0
    first_wait_s: float = 0.5
    max_wait_s: float = 30.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("window_s", "first_wait_s", "max_wait_s"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidInput(f"must be > 0, not {value}", field=name)
        attempt = self.attempt_timeout_s
        if attempt is not None:
            if not attempt > 0:
                raise InvalidInput(f"must be > 0, not {attempt}", field="attempt_timeout_s")
            if not attempt < self.window_s:
                raise InvalidInput(
                    f"each attempt's timeout ({attempt:g} s) must be shorter than the retry "
                    f"window ({self.window_s:g} s): a hung attempt would use up the window "
                    "before any retry",
                    field="attempt_timeout_s",
                )

    @property
    def attempt_s(self) -> float:
        """Each attempt's deadline, in seconds."""
        if self.attempt_timeout_s is not None:
            return self.attempt_timeout_s
        return min(DEFAULT_ATTEMPT_TIMEOUT_S, self.window_s / 2)


# Long enough for any call but a weights publish on a loaded gateway (a lease's long poll
# waits 5 s; the others are a few database statements); publishes set their own.
DEFAULT_ATTEMPT_TIMEOUT_S = 60.0


class AttemptTimeout(httpx.TimeoutException):
    """One attempt got no whole answer within its `RetryPolicy.attempt_timeout_s`."""


async def send_buffered(
    transport: httpx.AsyncBaseTransport, request: httpx.Request
) -> tuple[httpx.Response, bytes]:
    """Send once and read the whole body here, so a body cut short is a transport error of
    this send (one a retry can cover), not of a later read; the answer and its body."""
    response = await transport.handle_async_request(request)
    try:
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    buffered = httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(body),
        extensions=response.extensions,
    )
    return buffered, body


class _RetryableAnswer(Exception):
    def __init__(self, status_code: int, body: bytes) -> None:
        super().__init__(f"HTTP {status_code}: {body[:300].decode(errors='replace')}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _RetryableAnswer):
        return str(exc)
    said = str(exc).rstrip(".")
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


class RetryingTransport(httpx.AsyncBaseTransport):
    """Sends a request until it gets an answer the caller should see, under `policy`.

    Retried: transport errors (refused or broken connections, timeouts, a peer that
    hung up mid-answer), attempts that got no whole answer within the policy's
    `attempt_timeout_s` (`AttemptTimeout`) and 502/503/504 answers; one WARNING per retry
    names the call, the error, the attempt and the wait. Past the window it raises
    `GatewayUnavailable`, whose message is one line. Answers are read whole inside the
    attempt (a body cut short is retried too), so this suits calls with JSON bodies, not
    streams.

    Every request is resent as it was: callers route through it only the calls that are
    safe to repeat, or that they make safe (docs/training.md, "When the gateway goes
    away").
    """

    def __init__(
        self, policy: RetryPolicy, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.policy = policy
        self._inner = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        call = f"{request.method} {request.url.copy_with(query=None)}"
        policy = self.policy
        first_failure: float | None = None
        sent = time.monotonic()  # when the attempt now running (or the last one) was sent

        def left() -> float:
            """Seconds left in the window, which opens when the call's first failed attempt
            was sent: a hung attempt's wait counts, so a gateway that hangs costs the
            window at most (plus the last attempt's deadline), not window + deadline."""
            nonlocal first_failure
            first_failure = sent if first_failure is None else first_failure
            return first_failure + policy.window_s - time.monotonic()

        backoff = tenacity.wait_random_exponential(
            multiplier=policy.first_wait_s, max=policy.max_wait_s
        )

        def out_of_time(state: tenacity.RetryCallState) -> bool:
            return left() <= 0

        def wait(state: tenacity.RetryCallState) -> float:
            return max(0.0, min(backoff(state), left()))  # the last retry at the window's end

        def announce(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None and state.next_action is not None
            error = state.outcome.exception()
            assert error is not None
            log.warning(
                "%s failed (attempt %d): %s; retrying in %.1f s",
                call,
                state.attempt_number,
                _describe(error),
                state.next_action.sleep,
            )

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type((*_TRANSIENT, _RetryableAnswer)),
            stop=out_of_time,
            wait=wait,
            before_sleep=announce,
            reraise=True,
        )
        attempts = 0
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    sent = time.monotonic()
                    return await self._send_once(request)
        except (*_TRANSIENT, _RetryableAnswer) as exc:
            origin = f"{request.url.scheme}://{request.url.netloc.decode()}"
            raise GatewayUnavailable(
                f"the gateway at {origin} did not answer for {policy.window_s:g} s "
                f"({request.method} {request.url.path}, {attempts} attempts; "
                f"last error: {_describe(exc)})"
            ) from exc
        raise AssertionError("unreachable: tenacity returns or raises")

    async def _send_once(self, request: httpx.Request) -> httpx.Response:
        # A deadline on the whole exchange, not an inactivity timeout: a gateway working on
        # a call (switching its engines to new weights, say) sends nothing until it is done,
        # so silence alone cannot tell it from a hung one. The answer is read whole inside
        # the deadline (`send_buffered`), so it also bounds a body that trickles.
        deadline = self.policy.attempt_s
        try:
            async with asyncio.timeout(deadline):
                response, body = await send_buffered(self._inner, request)
        except TimeoutError:
            raise AttemptTimeout(f"no answer within {deadline:g} s", request=request) from None
        if response.status_code in RETRY_STATUSES:
            raise _RetryableAnswer(response.status_code, body)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
