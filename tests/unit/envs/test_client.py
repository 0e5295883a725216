"""RemoteEnv's retry and error mapping, at the HTTP transport boundary."""

import json

import httpx
import pytest

from envs.base import EnvCapacity, EpisodeFinished, InvalidAction, StepTimeout, TextAction
from envs.client import RemoteEnv

RESULT = {"observation": {"messages": []}, "reward": 0.0, "terminated": False, "truncated": False}


def remote(handler) -> RemoteEnv:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    env = RemoteEnv("http://env", client=client, retries=2)
    env.session_id = "s1"
    return env


async def test_step_retries_transport_errors_and_503_with_the_same_request_id() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["request_id"])
        if len(seen) == 1:
            raise httpx.ConnectError("refused")
        if len(seen) == 2:
            return httpx.Response(503, json={"detail": "busy", "code": "CAPACITY_REACHED"})
        return httpx.Response(200, json=RESULT)

    env = remote(handler)
    await env.step(TextAction(text="1"))
    assert len(seen) == 3 and len(set(seen)) == 1
    await env._client.aclose()


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (422, "INVALID_ACTION", InvalidAction),
        (409, "EPISODE_FINISHED", EpisodeFinished),
        (504, "STEP_TIMEOUT", StepTimeout),
        (503, "CAPACITY_REACHED", EnvCapacity),
    ],
)
async def test_errors_are_raised_as_the_server_named_them(
    status: int, code: str, error: type
) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(status, json={"detail": "no", "code": code})

    env = remote(handler)
    with pytest.raises(error):
        await env.step(TextAction(text="1"))
    assert calls == (3 if status == 503 else 1)  # only the transient is retried
    assert env.session_id == (None if status == 504 else "s1")
    await env._client.aclose()


async def test_fastapi_validation_errors_map_by_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"detail": [{"loc": ["body"], "msg": "bad"}]})

    env = remote(handler)
    with pytest.raises(InvalidAction, match="HTTP 422"):
        await env.step(TextAction(text="1"))
    await env._client.aclose()
