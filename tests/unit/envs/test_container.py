"""ContainerEnv at the docker SDK boundary: the exact run parameters, and clean-up."""

import socket

import pytest

from envs import registry
from envs.base import EnvError, EpisodeFinished, TextAction
from envs.container import LABEL, ContainerEnv
from envs.registry import parse_spec
from envs.specs import ContainerEnvSpec
from tests.unit.envs.fakes import RecordingDockerClient


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_container_is_started_locked_down_and_removed_when_not_ready() -> None:
    spec = parse_spec(
        "container",
        {"image": "lab/env:1", "command": ["python", "-m", "envs.server", "x"], "env": {"A": "1"}},
    )
    assert isinstance(spec, ContainerEnvSpec)
    docker = RecordingDockerClient(host_port=closed_port())
    env = registry.resolve(spec, docker_client=docker)
    assert isinstance(env, ContainerEnv)
    env.ready_timeout_s = 0.3
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="1"))
    with pytest.raises(EnvError, match="not ready"):
        await env.reset(seed=1)
    ((args, kwargs),) = docker.runs
    assert args == ("lab/env:1", ["python", "-m", "envs.server", "x"])
    assert kwargs == {
        "detach": True,
        "environment": {"A": "1"},
        "ports": {"8000/tcp": ("127.0.0.1", None)},
        "labels": {LABEL: "1"},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
    }
    assert docker.started[0].calls == ["reload", "remove(force=True)"]
    await env.close()
    assert docker.started[0].calls == ["reload", "remove(force=True)"]  # removed once
