"""Text, numbers and callers an attacker would send, on SQLite and PostgreSQL alike.

Every answer is 2xx or 4xx with a JSON body, never a 5xx or a dropped connection; what a
2xx stored reads back equal; a caller with no key, or the wrong one, is told 401 before
anything about its request is validated.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentflow.agents.keys import episode_key
from agentflow.api.app import create_app
from agentflow.api.deps import AUTH_CHECKS
from agentflow.api.routing import GatewayRoute
from agentflow.config import Settings

pytestmark = pytest.mark.integration

API_KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENV = "tests.integration.rollout.scripted_envs:SlowEnv"

# Any text at all: what hypothesis draws (controls and lone surrogates included), and the
# cases the hardening is about, verbatim.
hostile_text = st.one_of(
    st.text(),
    st.text(st.characters(categories=["Cs", "Cc", "Zs", "Co"]), max_size=8),
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfffy", "\x01\x1b[31m\x7f"]),
    st.sampled_from(["x", "é", "\x00"]).map(lambda c: c * (200_000 // len(c.encode()))),
)


def _raw(body: Any) -> bytes:
    """JSON as an attacker writes it: lone surrogates escaped, nothing refused."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def _meant(value: Any) -> Any:
    """What `value` sent as `_raw` JSON means: two escaped surrogates that form a pair
    are one character in JSON (`"\\ud800\\udc00"` is U+10000), so that is what a
    gateway stores and reads back."""
    return json.loads(_raw(value))


@pytest.fixture
async def http(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(database_url=database_url, api_key=API_KEY))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


async def _send(
    http: httpx.AsyncClient, method: str, path: str, body: Any = None, **kwargs: Any
) -> httpx.Response:
    headers = {"content-type": "application/json", **kwargs.pop("headers", AUTH)}
    content = body if isinstance(body, bytes) else None if body is None else _raw(body)
    response = await http.request(method, path, content=content, headers=headers, **kwargs)
    assert response.status_code < 500, (path, response.status_code, response.text[:500])
    response.json()  # a body that is valid JSON, whatever was echoed
    return response


def _quoted(text: str) -> str:
    """Percent-encoded as a client that does not check would send it."""
    return quote(text, safe="", errors="surrogatepass")


def _ok(response: httpx.Response) -> bool:
    return 200 <= response.status_code < 300


HYPOTHESIS = settings(
    max_examples=40,
    deadline=None,
    # Each example makes its own rows (a fresh env name, a fresh run), so the shared
    # app and database never carry one example's data into another's assertions.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@HYPOTHESIS
@given(text=hostile_text, key=hostile_text)
async def test_env_text_is_refused_or_stored_exactly(
    http: httpx.AsyncClient, text: str, key: str
) -> None:
    name = f"env-{uuid.uuid4().hex[:8]}"
    tool = {"name": "act", "description": text, "parameters": {"type": "object", "x": text}}
    body = {
        "name": name,
        "kind": "python",
        "spec": {"entry_point": ENV, "kwargs": {key: text, "nested": [text, {"deep": text}]}},
        "tools": [{"type": "function", "function": tool}],
        "description": text,
    }
    created = await _send(http, "POST", "/v1/envs", body)
    if _ok(created):
        stored = (await _send(http, "GET", f"/v1/envs/{created.json()['id']}")).json()
        assert stored["description"] == _meant(text)
        assert stored["spec"]["kwargs"] == _meant(body["spec"]["kwargs"])  # type: ignore[index]
        assert stored["tools"][0]["function"]["description"] == _meant(text)
        patched = await _send(http, "PATCH", f"/v1/envs/{name}", {"description": text[::-1]})
        if _ok(patched):
            again = await _send(http, "GET", f"/v1/envs/{name}")
            assert again.json()["description"] == _meant(text[::-1])
    else:
        assert created.status_code == 422
    await _send(http, "GET", "/v1/envs?name=" + _quoted(text[:2000]))
    await _send(
        http, "GET", "/v1/envs/" + quote(text[:100] or "-", safe="", errors="surrogatepass")
    )


@HYPOTHESIS
@given(text=hostile_text)
async def test_run_text_is_refused_or_stored_exactly(http: httpx.AsyncClient, text: str) -> None:
    config = {
        "name": text[:300],
        "model": {"init": {"layers": 1, "hidden": 16, "heads": 2, "max_context": 64}},
        "envs": [{"id": "agentflow/guess-number-v0"}],
        "agent": {"system_prompt": text},
    }
    created = await _send(http, "POST", "/v1/runs", config, params={"start": "false"})
    if _ok(created):
        stored = (await _send(http, "GET", f"/v1/runs/{created.json()['id']}")).json()
        assert stored["name"] == _meant(config["name"])
        assert stored["config"]["agent"]["system_prompt"] == _meant(text)
    await _send(http, "GET", "/v1/runs?name=" + _quoted(text[:2000]))


@HYPOTHESIS
@given(text=hostile_text)
async def test_callback_text_never_fails_the_gateway(http: httpx.AsyncClient, text: str) -> None:
    episode = uuid.uuid4()  # unknown here: past the key and the body, a 404
    key = episode_key(episode, http.app.state.settings.secret_key)  # type: ignore[attr-defined]
    headers = {"Authorization": f"Bearer {key}"}
    base = f"/v1/episodes/{episode}"
    bodies = {
        "/complete": {"status": "failed", "answer": text, "error": text},
        "/env/step": {"action": {"tool": text, "arguments": {text: text}}},
        "/reward": {"reward": 1.0, "note": text},
    }
    for suffix, body in bodies.items():
        response = await _send(http, "POST", base + suffix, body, headers=headers)
        assert response.status_code in (404, 422), response.text


async def test_unstorable_text_is_named_in_the_422(http: httpx.AsyncClient) -> None:
    body = {"name": "named", "kind": "python", "spec": {"entry_point": ENV, "kwargs": {}}}
    body["spec"]["kwargs"] = {"ok": ["fine", {"bad": "a\x00b"}]}  # type: ignore[index]
    response = await _send(http, "POST", "/v1/envs", body)
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "spec", "kwargs", "ok", "1", "bad"]
    assert "NUL" in error["msg"]
    body["spec"]["kwargs"] = {"\udc80": 1}  # type: ignore[index]
    response = await _send(http, "POST", "/v1/envs", body)
    assert response.status_code == 422 and "surrogate" in response.json()["detail"][0]["msg"]
    query = await _send(http, "GET", "/v1/envs", params={"name": "a\x00"})
    assert query.status_code == 422 and query.json()["detail"][0]["loc"] == ["query", "name"]


BAD_NUMBERS = {
    "NaN": b'{"x": NaN}',
    "Infinity": b'{"x": Infinity}',
    "-Infinity": b'{"x": [1, -Infinity]}',
    "1e999": b'{"x": 1e999}',
    "5000 digits": b'{"x": ' + b"9" * 5000 + b"}",
    "not UTF-8": b'{"x": "\xff\xfe"}',
}


def api_routes(app: Any) -> list[APIRoute]:
    """Every API route of the app, through the routers it includes."""
    found: list[APIRoute] = []
    stack = list(app.routes)
    while stack:
        route = stack.pop()
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):  # an included router
            stack.extend(route.original_router.routes)
    return found


def _body_routes(app: Any) -> list[APIRoute]:
    """Routes that read a JSON body; not the dashboard's sign-in and sign-out, form posts
    answered with a page (`tests/integration/ui` sends them garbage)."""
    return [r for r in api_routes(app) if r.methods & {"POST", "PATCH"} and r.include_in_schema]


def _path(route: APIRoute) -> str:
    return re.sub(r"\{[^}]+\}", str(uuid.uuid4()), route.path)


async def test_non_finite_and_huge_numbers_in_any_body_are_4xx(http: httpx.AsyncClient) -> None:
    routes = _body_routes(http.app)  # type: ignore[attr-defined]
    assert len(routes) >= 10
    for route in routes:
        for method in route.methods & {"POST", "PATCH"}:
            for name, raw in BAD_NUMBERS.items():
                response = await _send(http, method, _path(route), raw)
                assert 400 <= response.status_code < 500, (route.path, name)
    # Inside a field pydantic would otherwise have echoed back: still valid JSON, and said.
    response = await _send(http, "POST", "/v1/runs", b'{"name": "r", "seed": NaN}')
    assert response.status_code == 422 and "NaN" in response.json()["detail"][0]["msg"]


async def test_every_keyed_route_answers_401_before_validating(http: httpx.AsyncClient) -> None:
    app = http.app  # type: ignore[attr-defined]
    keyed = [r for r in api_routes(app) if any(d.dependency in AUTH_CHECKS for d in r.dependencies)]
    assert len(keyed) >= 20
    garbage = b'{"not": "what any route wants", "x": NaN, "y": "\\u0000"'  # and unfinished
    for route in keyed:
        for method in route.methods:
            path = _path(route)
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}):
                response = await _send(http, method, path, garbage, headers=headers)
                assert response.status_code == 401, (method, route.path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"


def test_every_route_authenticates_and_parses_the_one_way() -> None:
    app = create_app(Settings(database_url="sqlite+aiosqlite:///unused.db"))
    # The OpenAI-compatible routes authenticate and parse in the handler (same rules),
    # to answer in OpenAI's error shape; the health checks need neither.
    exempt = {
        "/v1/chat/completions",
        "/v1/episodes/{episode_id}/chat/completions",
        "/v1/responses",
        "/v1/episodes/{episode_id}/responses",
        "/v1/models",
        "/v1/models/{model_id:path}",
    }
    routes = api_routes(app)
    assert len(routes) >= 25
    for route in routes:
        if route.path not in exempt and route.tags != ["health"]:
            assert isinstance(route, GatewayRoute), route.path
