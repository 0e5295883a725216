"""`ContainerEnv`: an env server started from a container image, played over HTTP.

The container is started through a docker SDK client (``docker.DockerClient``) on the
first ``reset``: detached, its server port published on 127.0.0.1 only, all capabilities
dropped, ``no-new-privileges``, labelled ``agentflow.env`` so leftovers can be found and
removed by label. The env is then a :class:`RemoteEnv` to that server; ``close`` removes
the container. There is no Docker engine on the project's own machines, so this is
tested against a recording fake client (the SDK boundary).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from envs import registry
from envs.base import Action, EnvClosed, EnvConfigError, EnvError, EpisodeFinished, StepResult
from envs.client import RemoteEnv
from envs.specs import ContainerEnvSpec

LABEL = "agentflow.env"


class ContainerEnv:
    """One container per env instance, started lazily, removed on close."""

    def __init__(
        self,
        spec: ContainerEnvSpec,
        docker_client: Any,
        *,
        ready_timeout_s: float = 60.0,
        remote_options: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.docker = docker_client
        self.ready_timeout_s = ready_timeout_s
        self.remote_options = dict(remote_options or {})
        self.container: Any = None
        self.remote: RemoteEnv | None = None
        self._closed = False

    async def _start(self) -> RemoteEnv:
        port_key = f"{self.spec.port}/tcp"
        self.container = await asyncio.to_thread(
            self.docker.containers.run,
            self.spec.image,
            self.spec.command,
            detach=True,
            environment=dict(self.spec.env),
            ports={port_key: ("127.0.0.1", None)},
            labels={LABEL: "1"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
        )
        await asyncio.to_thread(self.container.reload)
        try:
            host_port = self.container.attrs["NetworkSettings"]["Ports"][port_key][0]["HostPort"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EnvError(f"container publishes no port for {port_key}") from exc
        base_url = f"http://127.0.0.1:{host_port}"
        await self._wait_ready(base_url)
        return RemoteEnv(base_url, **self.remote_options)

    async def _wait_ready(self, base_url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                try:
                    if (await client.get(base_url + "/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EnvError(f"env server in {self.spec.image!r} not ready in time")
                await asyncio.sleep(0.2)

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        if self._closed:
            raise EnvClosed("container env is closed")
        if self.remote is None:
            try:
                self.remote = await self._start()
            except BaseException:
                await self._remove()
                raise
        return await self.remote.reset(seed=seed, options=options)

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        if self._closed:
            raise EnvClosed("container env is closed")
        if self.remote is None:
            raise EpisodeFinished("call reset first")
        return await self.remote.step(action, timeout_s=timeout_s)

    async def state(self) -> dict[str, Any]:
        if self.remote is None:
            return {"image": self.spec.image, "started": False}
        return await self.remote.state()

    def tools(self) -> list[dict[str, Any]]:
        return self.remote.tools() if self.remote is not None else []

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.remote is not None:
                await self.remote.close()
        finally:
            await self._remove()

    async def _remove(self) -> None:
        if self.container is not None:
            container, self.container = self.container, None
            await asyncio.to_thread(container.remove, force=True)


def from_spec(spec: ContainerEnvSpec, docker_client: Any | None = None) -> ContainerEnv:
    """The env a registered `container` spec describes, started through `docker_client`
    (a `docker.DockerClient`); without one there is no runtime to start it with."""
    if docker_client is None:
        raise EnvConfigError(
            "container envs need a container runtime: pass docker_client= "
            "(a docker.DockerClient) to resolve(), or serve the image yourself and "
            "register it as an 'http' env"
        )
    return ContainerEnv(spec, docker_client)


def register() -> None:
    """Register the `container` kind: env servers started from container images."""
    registry.register_kind("container", ContainerEnvSpec, from_spec, replace=True)
