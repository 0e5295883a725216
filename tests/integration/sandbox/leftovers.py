"""Proof that a closed sandbox left nothing behind, per backend."""

from __future__ import annotations

from typing import Any

from sandbox.bwrap import BwrapSandbox
from sandbox.docker_backend import LABEL, DockerSandbox

from .procscan import sandbox_processes


def assert_bwrap_sandbox_gone(sb: BwrapSandbox) -> None:
    assert sandbox_processes(sb.id) == [], f"processes left behind by sandbox {sb.id}"
    assert sandbox_processes(sb.workdir) == []


def assert_docker_sandbox_gone(client: Any, sb: DockerSandbox) -> None:
    """No container, no volume and no host process of the sandbox is left."""
    selector = {"label": f"{LABEL}={sb.id}"}
    assert client.containers.list(all=True, filters=selector) == []
    assert client.volumes.list(filters=selector) == []
    # The tests' engine runs on this machine: the container's cgroup path names its id.
    assert sandbox_processes(sb.container.id) == [], f"processes left by sandbox {sb.id}"
