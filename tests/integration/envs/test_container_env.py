"""ContainerEnv end to end, with the 'container' played by a real env server on loopback."""

from urllib.parse import urlparse

import pytest

from envs import registry
from envs.registry import parse_spec
from envs.server import create_app
from tests.support.play import play_episode
from tests.unit.envs.fakes import RecordingDockerClient

pytestmark = pytest.mark.integration


async def test_container_env_plays_and_removes_its_container(serve_app) -> None:
    env_id = "agentflow/guess-number-v0"
    url = serve_app(create_app({env_id: lambda: registry.make(env_id)}))
    docker = RecordingDockerClient(host_port=urlparse(url).port or 0)
    spec = parse_spec("container", {"image": "lab/guess:1", "command": ["serve"]})
    env = registry.resolve(spec, docker_client=docker)
    episode = await play_episode(env, registry.oracle(env_id), seed=3)
    assert episode.success
    assert (await env.state())["env"] == env_id
    await env.close()
    assert docker.started[0].calls == ["reload", "remove(force=True)"]
    assert len(docker.runs) == 1
