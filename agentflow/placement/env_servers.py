"""Env servers as Ray actors (`placement.env_servers`).

Each built-in env of a run's mix is served by that many actors, each an env server
(`envs/server.py`, the same protocol a registered `http` env speaks) on its node; the
run's episodes of that env are spread over them round-robin, each playing a `RemoteEnv`.
The gateway then holds no env state: a slow or heavy env scales out with actors. An actor
that dies fails the episodes it was serving, each with the env server's error recorded;
the next episodes go on to the other servers and to its replacement.
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


class EnvServerHost:
    """The body of an env-server actor: one env served over HTTP from this process."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], max_sessions: int, host: str):
        self.env_id, self.kwargs, self.host = env_id, kwargs, host
        self.max_sessions = max_sessions
        self._server: Any = None

    async def start(self) -> str:
        """Serve on a free port; returns the server's base URL."""
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


@dataclasses.dataclass
class EnvServers:
    """A run's env-server actors and where each env is served."""

    actors: list[Any]
    urls: dict[str, list[str]]
    group: Any

    def sources(self, sources: list[EnvSource]) -> list[EnvSource]:
        """`sources` with each served env played over its servers."""
        placed = []
        for source in sources:
            urls = self.urls.get(source.ref)
            if urls is None or source.kind is not None:
                placed.append(source)
                continue
            placed.append(
                dataclasses.replace(source, make_env=_RoundRobin(source.ref, tuple(urls)))
            )
        return placed

    async def close(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.stop.remote(), 10.0)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


class _RoundRobin:
    """Makes `RemoteEnv`s of one env, each on the next of its servers."""

    def __init__(self, env_id: str, urls: tuple[str, ...]) -> None:
        self.env_id, self.urls = env_id, urls
        self._next = itertools.count()

    def __call__(self) -> Env:
        from envs.client import RemoteEnv

        url = self.urls[next(self._next) % len(self.urls)]
        return RemoteEnv(url, env=self.env_id)


async def place_env_servers(config: RunConfig, sources: list[EnvSource]) -> EnvServers:
    """Start `placement.env_servers` actors for each built-in env among `sources`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placement = config.placement
    ray = connect(placement.ray, object_store_mb=placement.object_store_mb)
    served = [s for s in sources if s.kind is None]
    count = placement.env_servers * len(served)
    group = ray.util.placement_group(
        [{"CPU": placement.env_cpus}] * count, strategy=placement.strategy
    )
    await asyncio.wait_for(group.ready(), _READY_TIMEOUT_S)
    host = LOOPBACK if placement.ray == "local" else ""  # "": the actor's node address
    actors: list[Any] = []
    urls: dict[str, list[str]] = {}
    try:
        bundle = 0
        starts = []
        for source in served:
            for _ in range(placement.env_servers):
                options = {
                    "num_cpus": placement.env_cpus,
                    "max_restarts": 0,
                    "max_concurrency": 4 * source.max_concurrency + 16,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=bundle
                    ),
                }
                bundle += 1
                actor = (
                    ray.remote(EnvServerHost)
                    .options(**options)
                    .remote(
                        source.ref,
                        dict(source.kwargs),
                        source.max_concurrency + 16,
                        host,
                    )
                )
                actors.append(actor)
                starts.append((source.ref, actor.start.remote()))
        for ref, start in starts:
            url = await asyncio.wait_for(start, _READY_TIMEOUT_S)
            urls.setdefault(ref, []).append(str(url))
    except Exception as exc:
        await EnvServers(actors, urls, group).close()
        raise EnvError(f"env-server actors did not start: {exc}") from None
    log.info("placed %d env-server actors: %s", len(actors), urls)
    return EnvServers(actors, urls, group)
