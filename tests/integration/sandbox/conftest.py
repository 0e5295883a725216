from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from sandbox import SandboxLimits
from sandbox.bwrap import BwrapSandbox
from sandbox.docker_backend import DockerSandbox

from .leftovers import assert_bwrap_sandbox_gone, assert_docker_sandbox_gone

if shutil.which("bwrap") is None:  # pragma: no cover - bwrap is a documented requirement
    pytest.fail("bubblewrap (bwrap) must be installed for the sandbox integration tests")

DEFAULT_LIMITS = SandboxLimits(wall_time_s=5, cpu_time_s=5)


@pytest.fixture
async def make_sandbox() -> AsyncIterator[Callable[..., BwrapSandbox]]:
    """Open bwrap sandboxes; on teardown close them and prove nothing is left running."""
    async with _opened(Backend("bwrap")) as make:
        yield make  # type: ignore[misc]  # the bwrap backend opens BwrapSandbox only


@pytest.fixture
def docker_client(sandbox_runtime_image: str) -> Iterator[Any]:
    """A docker SDK client for the engine the session fixture made sure of."""
    import docker

    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()  # its pooled engine connections would otherwise leak (ResourceWarning)


@dataclass(frozen=True)
class Backend:
    name: str
    image: str = ""
    client: Any = None


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each test that uses this runs against bwrap and against a real Docker engine."""
    if request.param == "bwrap":
        return Backend("bwrap")
    return Backend(
        "docker",
        image=request.getfixturevalue("sandbox_runtime_image"),
        client=request.getfixturevalue("docker_client"),
    )


@pytest.fixture
async def make_any_sandbox(
    backend: Backend,
) -> AsyncIterator[Callable[..., BwrapSandbox | DockerSandbox]]:
    """Open sandboxes of ``backend``; on teardown close them and prove nothing is left."""
    async with _opened(backend) as make:
        yield make


@contextlib.asynccontextmanager
async def _opened(backend: Backend) -> AsyncIterator[Callable[..., BwrapSandbox | DockerSandbox]]:
    opened: list[BwrapSandbox | DockerSandbox] = []

    def make(**kwargs) -> BwrapSandbox | DockerSandbox:
        kwargs.setdefault("limits", DEFAULT_LIMITS)
        sb: BwrapSandbox | DockerSandbox
        if backend.name == "bwrap":
            sb = BwrapSandbox(**kwargs)
        else:
            sb = DockerSandbox(image=backend.image, client=backend.client, **kwargs)
        opened.append(sb)
        return sb

    yield make
    for sb in opened:
        await sb.close()
    for sb in opened:
        if isinstance(sb, BwrapSandbox):
            assert_bwrap_sandbox_gone(sb)
        else:
            assert_docker_sandbox_gone(backend.client, sb)
