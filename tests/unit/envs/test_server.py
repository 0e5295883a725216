"""The env server's HTTP routes, driven in process through ASGI."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fastapi import FastAPI

from envs.server import create_app
from envs.sessions import EnvFactory
from tests.unit.envs.fakes import CountingEnv, HangingEnv, RaisingEnv, ThreadCheckingEnv

PLUS = {"type": "text", "text": "+"}


def app_with(factories: dict[str, EnvFactory], **opts: object) -> FastAPI:
    return create_app(factories, **opts)  # type: ignore[arg-type]


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    clients: list[tuple[httpx.AsyncClient, FastAPI]] = []

    def make(app: FastAPI) -> httpx.AsyncClient:
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        clients.append((client, app))
        return client

    yield make
    for client, app in clients:
        await app.state.sessions.close_all()
        await client.aclose()


async def open_session(client: httpx.AsyncClient, env: str | None = None) -> str:
    response = await client.post("/v1/sessions", json={"env": env, "seed": 1})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


async def test_session_lifecycle(client_for) -> None:
    client = client_for(app_with({"test/counting-v0": CountingEnv}))
    created = await client.post("/v1/sessions", json={"seed": 1})
    assert created.status_code == 201
    body = created.json()
    assert body["env"] == "test/counting-v0" and body["tools"] == []
    assert body["result"]["observation"]["messages"][0]["content"] == "count to 3"
    sid = body["session_id"]
    for expected in (False, False, True):
        step = await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})
        assert step.status_code == 200 and step.json()["terminated"] is expected
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["steps"] == 3 and state["state"]["done"] is True
    reset = await client.post(f"/v1/sessions/{sid}/reset", json={"seed": 2})
    assert reset.status_code == 200 and reset.json()["terminated"] is False
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204
    assert (await client.get(f"/v1/sessions/{sid}/state")).status_code == 404
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 404


async def test_bad_input_status_codes_and_the_server_keeps_serving(client_for) -> None:
    factories: dict[str, EnvFactory] = {
        "test/counting-v0": CountingEnv,
        "test/raising-v0": RaisingEnv,
        "test/hanging-v0": HangingEnv,
    }
    app = app_with(factories, step_timeout_s=5.0)
    client = client_for(app)
    manager = app.state.sessions

    unknown = await client.post("/v1/sessions", json={"env": "test/nope-v0"})
    assert unknown.status_code == 404 and unknown.json()["code"] == "NOT_FOUND"

    sid = await open_session(client, "test/counting-v0")
    for bad in ({"type": "text"}, {"type": "teleport"}, {"text": "+"}, "plus"):
        response = await client.post(f"/v1/sessions/{sid}/step", json={"action": bad})
        assert response.status_code == 422, bad
    assert (await client.post(f"/v1/sessions/{sid}/step", json={})).status_code == 422
    assert (await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})).status_code == 200

    for _ in range(2):
        await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})
    late = await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})
    assert late.status_code == 409 and late.json()["code"] == "EPISODE_FINISHED"
    assert (await client.post(f"/v1/sessions/{sid}/reset", json={})).status_code == 200

    hanging = await open_session(client, "test/hanging-v0")
    hanging_env = manager.sessions[hanging].env
    timed_out = await client.post(
        f"/v1/sessions/{hanging}/step", json={"action": PLUS, "timeout_s": 0.1}
    )
    assert timed_out.status_code == 504 and timed_out.json()["code"] == "STEP_TIMEOUT"
    assert hanging not in manager.sessions and hanging_env.closed_calls == 1
    assert (await client.get(f"/v1/sessions/{hanging}/state")).status_code == 404

    raising = await open_session(client, "test/raising-v0")
    raising_env = manager.sessions[raising].env
    assert (
        await client.post(f"/v1/sessions/{raising}/step", json={"action": PLUS})
    ).status_code == 200
    crashed = await client.post(f"/v1/sessions/{raising}/step", json={"action": PLUS})
    assert crashed.status_code == 500 and "simulated env bug" in crashed.json()["detail"]
    assert raising not in manager.sessions and raising_env.closed_calls == 1

    assert (await client.get("/healthz")).json()["sessions"] == 1
    assert (await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})).status_code == 200


async def test_capacity_is_503(client_for) -> None:
    client = client_for(app_with({"test/counting-v0": CountingEnv}, max_sessions=2))
    first = await open_session(client)
    await open_session(client)
    full = await client.post("/v1/sessions", json={})
    assert full.status_code == 503 and full.json()["code"] == "CAPACITY_REACHED"
    await client.delete(f"/v1/sessions/{first}")
    await open_session(client)


async def test_retried_step_with_the_same_request_id_applies_once(client_for) -> None:
    app = app_with({"test/counting-v0": CountingEnv})
    client = client_for(app)
    sid = await open_session(client)
    body = {"action": PLUS, "request_id": "r-1"}
    first, again = await asyncio.gather(
        client.post(f"/v1/sessions/{sid}/step", json=body),
        client.post(f"/v1/sessions/{sid}/step", json=body),
    )
    later = await client.post(f"/v1/sessions/{sid}/step", json=body)
    assert first.json() == again.json() == later.json()
    assert app.state.sessions.sessions[sid].env.count == 1


async def test_idle_sessions_are_reaped(client_for) -> None:
    app = app_with({"test/counting-v0": CountingEnv}, idle_ttl_s=0.05)
    client = client_for(app)
    stale = await open_session(client)
    env = app.state.sessions.sessions[stale].env
    await asyncio.sleep(0.1)
    fresh = await open_session(client)
    assert await app.state.sessions.reap_idle() == 1
    assert env.closed_calls == 1
    assert (await client.get(f"/v1/sessions/{stale}/state")).status_code == 404
    assert (await client.get(f"/v1/sessions/{fresh}/state")).status_code == 200


async def test_thread_per_session_keeps_each_env_on_its_own_thread(client_for) -> None:
    app = app_with({"test/thread-v0": ThreadCheckingEnv}, thread_per_session=True)
    client = client_for(app)
    sids = [await open_session(client) for _ in range(2)]
    envs = [app.state.sessions.sessions[s].env for s in sids]
    assert len({env.thread for env in envs} | {threading.get_ident()}) == 3
    for sid in sids:
        for _ in range(3):
            response = await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})
            assert response.status_code == 200, response.text
    runner = app.state.sessions.sessions[sids[0]].runner
    await client.delete(f"/v1/sessions/{sids[0]}")
    assert not runner.thread.is_alive()


async def test_openenv_http_routes(client_for) -> None:
    client = client_for(app_with({"test/counting-v0": CountingEnv}))
    assert (await client.get("/health")).json() == {"status": "healthy"}
    schema = (await client.get("/schema")).json()
    assert set(schema) == {"action", "observation", "state"}
    reset = (await client.post("/reset", json={"seed": 3})).json()
    assert reset["done"] is False and "messages" in reset["observation"]
    step = (await client.post("/step", json={"action": PLUS})).json()
    assert step["observation"]["messages"][0]["content"] == "1"
    assert (await client.post("/step", json={"action": {"type": "x"}})).status_code == 422
    assert (await client.get("/state")).status_code == 200


async def test_thread_bound_factories_get_their_own_thread(client_for) -> None:
    def build() -> ThreadCheckingEnv:
        return ThreadCheckingEnv()

    build.thread_bound = True  # type: ignore[attr-defined]
    app = app_with({"test/thread-v0": build})
    client = client_for(app)
    sid = await open_session(client)
    assert app.state.sessions.sessions[sid].env.thread != threading.get_ident()
    assert (await client.post(f"/v1/sessions/{sid}/step", json={"action": PLUS})).status_code == 200


def test_load_target_accepts_ids_and_dotted_paths() -> None:
    from envs.base import EnvConfigError, UnknownEnv
    from envs.server import load_target

    ((name, factory),) = load_target("agentflow/guess-number-v0").items()
    assert name == "agentflow/guess-number-v0" and factory().env_id == name  # type: ignore[attr-defined]
    ((name, factory),) = load_target("tests.unit.envs.fakes:CountingEnv").items()
    assert isinstance(factory(), CountingEnv)
    with pytest.raises(UnknownEnv):
        load_target("agentflow/absent-v0")
    with pytest.raises(EnvConfigError):
        load_target("envs.builtin.calc_tool:PROBLEMS")
