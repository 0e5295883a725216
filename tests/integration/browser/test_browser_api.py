"""A browser env registered through the gateway (POST /v1/envs) and played from its
stored spec, as a run's env source makes it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.rollout.envs import EnvSource
from envs import registry
from envs.browser.env import BrowserEnv
from envs.browser.oracles import ORACLES

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(sqlite_database: str) -> AsyncIterator[AsyncClient]:
    app = create_app(Settings(database_url=sqlite_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            yield client


async def test_register_and_play_a_browser_env(api: AsyncClient) -> None:
    name = f"browser-{uuid.uuid4().hex[:8]}"
    spec = {
        "task": "miniwob/login-user-v0",
        "screenshots": False,
        "viewport": [400, 300],
        "recycle_pages": False,
    }
    created = await api.create_env({"name": name, "kind": "browser", "spec": spec})
    assert created.kind == "browser" and created.spec["task"] == "miniwob/login-user-v0"
    assert created.spec["recycle_pages"] is False

    source = EnvSource(
        ref=name, weight=1.0, max_concurrency=1, step_timeout_s=10, kind=created.kind,
        spec=created.spec,
    )  # fmt: skip
    env = source.make()
    assert isinstance(env, BrowserEnv) and env.recycle_pages is False
    try:
        result = await env.reset(seed=4)
        assert result.observation.image is None
        history = [result.observation]
        while not result.done:
            result = await env.step(ORACLES["login-user"](history), timeout_s=10)
            history.append(result.observation)
        assert result.reward == 1.0 and len(history) == 4
    finally:
        await env.close()
        await registry.close_shared()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"task": "miniwob/no-such-task-v0"}, "task"),
        ({"task": "click-button"}, "task"),
        ({"task": "miniwob/click-button-v0", "headless": False}, "headless"),
        ({"task": "miniwob/click-button-v0", "viewport": [10, 10]}, "viewport"),
        ({"task": "miniwob/click-button-v0", "compact_chars": 5}, "compact_chars"),
        ({"task": "miniwob/click-button-v0", "recycle_pages": "sometimes"}, "recycle_pages"),
    ],
)
async def test_bad_browser_specs_are_refused_naming_the_field(
    sqlite_database: str, spec: dict[str, object], field: str
) -> None:
    app = create_app(Settings(database_url=sqlite_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await http.post(
                "/v1/envs", json={"name": "bad-browser", "kind": "browser", "spec": spec}
            )
    assert response.status_code == 422, response.text
    assert any(field in map(str, d["loc"]) for d in response.json()["detail"]), response.text
