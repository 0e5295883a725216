"""Env servers as Ray actors (`placement.env_servers`).

Each built-in env of a run's mix is served by that many actors, each an env server
(`envs/server.py`, the same protocol a registered `http` env speaks) on its node; the
run's episodes of that env are spread over them round-robin, each playing a `RemoteEnv`.
The gateway then holds no env state: a slow or heavy env scales out with actors.

A watcher asks every actor for its address every `_WATCH_S` seconds. One that died is
taken out of the rotation at once and a new actor is started in its bundle; the episodes
that were on the dead one fail, each with the env server's error recorded (their env
state is gone with it), and the next episodes go to the live servers and then to the
replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from typing import Any

from agentflow.placement.cluster import LOOPBACK, connect, import_ray
from agentflow.rollout.envs import EnvSource
from agentflow.run_config import RunConfig
from envs.base import Env, EnvError

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 120.0
_WATCH_S = 2.0
_ANSWER_S = 30.0  # a busy actor still answers within this


class EnvServerHost:
    """The body of an env-server actor: one env served over HTTP from this process."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], max_sessions: int, host: str):
        self.env_id, self.kwargs, self.host = env_id, kwargs, host
        self.max_sessions = max_sessions
        self._server: Any = None

    async def start(self) -> str:
        """Serve on a free port (once); returns the server's base URL."""
        from agentflow.api.loop_server import LoopServer
        from envs import registry
        from envs.server import create_app

        if self._server is None:
            if not self.host:
                self.host = import_ray().util.get_node_ip_address()
            app = create_app(
                {self.env_id: lambda: registry.make(self.env_id, **self.kwargs)},
                max_sessions=self.max_sessions,
            )
            self._server = await LoopServer(app, self.host, 0).__aenter__()
        return f"http://{self.host}:{self._server.port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.__aexit__(None, None, None)
            self._server = None


class _Rotation:
    """Makes `RemoteEnv`s of one env, each on the next of its live servers."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id
        self.urls: list[str] = []
        self._next = itertools.count()

    def __call__(self) -> Env:
        from envs.client import RemoteEnv

        if not self.urls:
            raise EnvError(f"no env server of {self.env_id} is live (being replaced)")
        url = self.urls[next(self._next) % len(self.urls)]
        return RemoteEnv(url, env=self.env_id)


@dataclasses.dataclass
class _Server:
    source: EnvSource
    bundle: int
    actor: Any = None
    url: str = ""


class EnvServers:
    """A run's env-server actors, where each env is served, and their watcher."""

    def __init__(self, config: RunConfig, group: Any, servers: list[_Server]) -> None:
        self.config = config
        self.group = group
        self.servers = servers
        self.rotations: dict[str, _Rotation] = {}
        self.replaced = 0
        self._watcher: asyncio.Task[None] | None = None

    @property
    def urls(self) -> dict[str, list[str]]:
        return {ref: list(rotation.urls) for ref, rotation in self.rotations.items()}

    async def start(self) -> None:
        starts = [self._start(server) for server in self.servers]
        failed = [r for r in await asyncio.gather(*starts, return_exceptions=True) if r]
        if failed:
            raise EnvError(f"env-server actors did not start: {failed[0]}")
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _start(self, server: _Server) -> BaseException | None:
        """Start `server`'s actor and put it in its env's rotation; the error, if any."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = import_ray()
        placement = self.config.placement
        source = server.source
        options = {
            "num_cpus": placement.env_cpus,
            "max_restarts": 0,  # replaced by the watcher, in the same bundle
            "max_concurrency": 4 * source.max_concurrency + 16,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=server.bundle
            ),
        }
        host = LOOPBACK if placement.ray == "local" else ""  # "": the actor's node address
        server.actor = (
            ray.remote(EnvServerHost)
            .options(**options)
            .remote(source.ref, dict(source.kwargs), source.max_concurrency + 16, host)
        )
        try:
            server.url = str(await asyncio.wait_for(server.actor.start.remote(), _READY_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            with contextlib.suppress(Exception):
                ray.kill(server.actor, no_restart=True)
            return exc
        rotation = self.rotations.setdefault(source.ref, _Rotation(source.ref))
        rotation.urls.append(server.url)
        return None

    async def _watch(self) -> None:
        ray = import_ray()
        while True:
            await asyncio.sleep(_WATCH_S)
            for server in self.servers:
                try:
                    await asyncio.wait_for(server.actor.start.remote(), _ANSWER_S)
                except (ray.exceptions.RayActorError, TimeoutError) as exc:
                    await self._replace(server, exc)

    async def _replace(self, server: _Server, exc: BaseException) -> None:
        rotation = self.rotations[server.source.ref]
        with contextlib.suppress(ValueError):
            rotation.urls.remove(server.url)  # no new episode goes there
        log.warning("env server %s of %s died (%s); replacing it", server.url, rotation.env_id, exc)
        with contextlib.suppress(Exception):
            import_ray().kill(server.actor, no_restart=True)
        error = await self._start(server)
        if error is None:
            self.replaced += 1
        else:
            log.error("env server of %s could not be replaced: %s", rotation.env_id, error)

    def sources(self, sources: list[EnvSource]) -> list[EnvSource]:
        """`sources` with each served env played over its servers."""
        return [
            dataclasses.replace(s, make_env=self.rotations[s.ref]) if s.ref in self.rotations else s
            for s in sources
        ]

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        ray = import_ray()
        for server in self.servers:
            if server.actor is None:
                continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.actor.stop.remote(), 10.0)
            with contextlib.suppress(Exception):
                ray.kill(server.actor, no_restart=True)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


async def place_env_servers(config: RunConfig, sources: list[EnvSource]) -> EnvServers:
    """Start `placement.env_servers` actors for each built-in env among `sources`."""
    placement = config.placement
    ray = connect(placement.ray, object_store_mb=placement.object_store_mb)
    served = [s for s in sources if s.kind is None]
    servers = [
        _Server(source, bundle=i * placement.env_servers + k)
        for i, source in enumerate(served)
        for k in range(placement.env_servers)
    ]
    group = ray.util.placement_group(
        [{"CPU": placement.env_cpus}] * len(servers), strategy=placement.strategy
    )
    await asyncio.wait_for(group.ready(), _READY_TIMEOUT_S)
    placed = EnvServers(config, group, servers)
    try:
        await placed.start()
    except BaseException:
        await placed.close()
        raise
    log.info("placed %d env-server actors: %s", len(servers), placed.urls)
    return placed
