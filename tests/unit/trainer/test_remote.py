"""`RepeatablePublish`: a weight publish resent after its answer was lost counts as done
when the gateway recorded that very version at that very directory, and only then. And a
publish through the trainer's own retry policies (`gateway_policies`) to a gateway that
hangs: each attempt ends at its deadline and is sent again within the window."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from agentflow.client import AsyncClient, GatewayUnavailable, RetryingTransport, RetryPolicy
from agentflow.errors import AgentFlowError
from agentflow.inference.base import WeightUpdate
from agentflow.run_config import GatewayCallsConfig
from tests.unit.test_client_retries import DROP, HANG, Reply, ScriptedGateway
from trainer.remote import RepeatablePublish, gateway_policies
from trainer.weights import GatewayWeightTarget

FAST = RetryPolicy(window_s=10.0, first_wait_s=0.01, max_wait_s=0.05)
RUN = str(uuid.uuid4())
UPDATE = WeightUpdate(path="/shared/weights/v000003", version=3)
NOT_NEWER = (422, {"detail": "weight version 3 is not newer than 3", "error": "EngineRequestError"})


def _recorded(version: int, uri: str) -> Reply:
    """`GET /v1/runs/{id}/metrics` listing one version."""
    row = {"version": version, "created_at": "2026-01-01T00:00:00Z", "uri": uri, "metrics": {}}
    return (200, {"run_id": RUN, "weight_version": version, "versions": [row]})


@asynccontextmanager
async def _publishing(
    replies: list[Reply], policy: RetryPolicy = FAST
) -> AsyncIterator[tuple[RepeatablePublish, ScriptedGateway]]:
    gateway = ScriptedGateway(replies)
    gateway.start()
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, transport=RetryingTransport(policy)) as http,
            AsyncClient(gateway.url, transport=RetryingTransport(policy)) as api,
        ):
            target = GatewayWeightTarget(gateway.url, RUN, client=api)
            yield RepeatablePublish(target, http, RUN), gateway
    finally:
        gateway.stop()


async def test_a_publish_whose_answer_was_lost_counts_once_recorded() -> None:
    replies = [DROP, NOT_NEWER, _recorded(3, UPDATE.path or "")]
    async with _publishing(replies) as (published, gateway):
        assert await published.update_weights(UPDATE) == 3
    calls = [(method, path) for method, path, _ in gateway.requests]
    assert calls == [
        ("POST", f"/v1/runs/{RUN}/weights"),
        ("POST", f"/v1/runs/{RUN}/weights"),
        ("GET", f"/v1/runs/{RUN}/metrics"),
    ]


@pytest.mark.parametrize(
    "recorded",
    [_recorded(3, "/elsewhere/v000003"), _recorded(2, UPDATE.path or ""), (404, {"detail": "no"})],
)
async def test_a_refused_publish_fails_unless_that_version_is_recorded_there(
    recorded: Reply,
) -> None:
    async with _publishing([NOT_NEWER, recorded]) as (published, _):
        with pytest.raises(AgentFlowError, match="not newer"):
            await published.update_weights(UPDATE)
        assert published.gave_up is None


async def test_a_gateway_that_stays_away_is_remembered_for_the_one_line() -> None:
    policy = RetryPolicy(window_s=0.2, first_wait_s=0.01, max_wait_s=0.05)
    async with _publishing([503], policy) as (published, _):
        with pytest.raises(GatewayUnavailable) as raised:
            await published.update_weights(UPDATE)
        assert published.gave_up is raised.value


# The trainer's policies with short deadlines: every call gets 0.3 s, a publish 0.6 s.
CALLS = GatewayCallsConfig(retry_window_s=4.0, attempt_timeout_s=0.3, publish_timeout_s=0.6)


def test_the_trainer_gives_publishes_their_own_deadline() -> None:
    calls, publishes = gateway_policies(CALLS)
    assert (calls.window_s, calls.attempt_s) == (4.0, 0.3)
    assert (publishes.window_s, publishes.attempt_s) == (4.0, 0.6)


async def test_a_publish_whose_attempts_hang_is_sent_again_within_the_window() -> None:
    _, publishes = gateway_policies(CALLS)
    async with _publishing([HANG, HANG, (200, {"version": 3})], publishes) as (published, gw):
        started = time.monotonic()
        assert await asyncio.wait_for(published.update_weights(UPDATE), 20) == 3
        assert 1.2 <= time.monotonic() - started < 4.0  # two deadlines, inside the window
    assert [path for _, path, _ in gw.requests] == [f"/v1/runs/{RUN}/weights"] * 3


async def test_a_publish_to_a_gateway_that_hangs_fails_after_the_window() -> None:
    _, publishes = gateway_policies(CALLS)
    async with _publishing([HANG], publishes) as (published, _):
        started = time.monotonic()
        with pytest.raises(GatewayUnavailable, match="no answer within 0.6 s") as raised:
            await asyncio.wait_for(published.update_weights(UPDATE), 20)
        assert 4.0 <= time.monotonic() - started < 4.0 + 0.6 + 2.0  # not the client's 1800 s
        assert published.gave_up is raised.value
