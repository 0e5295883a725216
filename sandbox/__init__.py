"""Sandboxes that really isolate tool code: bubblewrap (default on Linux) and Docker.

``open_sandbox("bwrap")`` returns a ready :class:`Sandbox`; see each backend's docstring
for what it isolates and what it does not. Also here: ``sandbox.pool.SandboxPool`` (warm
pool), ``sandbox.service`` (``POST /v1/exec``; ``python -m sandbox.service --port P``) and
``sandbox.client.HttpSandbox`` (the protocol over that service). This package imports
nothing from the gateway or the trainer.
"""

from __future__ import annotations

from typing import Any

from sandbox.base import (
    ExecResult,
    ExecStatus,
    Sandbox,
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    SandboxUnavailable,
)

BACKENDS = ("bwrap", "docker")


def open_sandbox(
    backend: str = "bwrap",
    *,
    limits: SandboxLimits | None = None,
    network: bool = False,
    **kwargs: Any,
) -> Sandbox:
    """Open a ready sandbox of ``backend`` (``"bwrap"`` or ``"docker"``).

    ``network=False`` (the default) gives the sandbox no network at all. Extra keyword
    arguments go to the backend's constructor (e.g. ``image=`` or ``client=`` for docker).
    Raises :class:`SandboxUnavailable` when the backend cannot run on this host.
    """
    limits = limits or SandboxLimits()
    if backend == "bwrap":
        from sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(limits=limits, network=network, **kwargs)
    if backend == "docker":
        from sandbox.docker_backend import DockerSandbox

        return DockerSandbox(limits=limits, network=network, **kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")


__all__ = [
    "BACKENDS",
    "ExecResult",
    "ExecStatus",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxFileError",
    "SandboxLimits",
    "SandboxUnavailable",
    "open_sandbox",
]
