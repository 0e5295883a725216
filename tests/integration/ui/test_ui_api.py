"""The dashboard's routes on both databases: who may read them, and what they answer."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.api.app import create_app
from agentflow.config import Settings
from agentflow.db.runs import RunStore
from agentflow.db.turn_tree import TurnTree
from agentflow.tokenization import ByteTokenizer
from agentflow.types import TurnRecord

pytestmark = pytest.mark.integration

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
# A run the gateway does not play (no engine is built): only its config is read, for the
# tokenizer of a model built from `model.init` (the byte tokenizer).
CONFIG: dict[str, Any] = {"name": "ui", "envs": [{"id": "agentflow/vault-v0"}]}


@pytest.fixture
async def gateway(database_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(Settings(database_url=database_url, api_key=KEY))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client, app


async def _run(app: Any, name: str = "ui") -> uuid.UUID:
    sessions: async_sessionmaker[AsyncSession] = app.state.sessionmaker
    runs = RunStore(sessions)
    run_id = await runs.create(name, {**CONFIG, "name": name})
    await runs.set_status(run_id, "stopped")
    return run_id


async def _episode(
    turns: TurnTree,
    run_id: uuid.UUID,
    *,
    env: str = "agentflow/vault-v0",
    versions: tuple[int, ...] = (1, 2),
    reward: float | None = 1.0,
    status: str = "completed",
    branch: bool = False,
) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """prompt → policy (one token per version) → env, and a re-rolled policy sibling."""
    episode = await turns.create_episode(run_id=run_id, env_ref=env)
    prompt = await turns.add_turn(episode, None, TurnRecord(kind="prompt", token_ids=(72, 105)))
    policy = TurnRecord(
        kind="policy",
        token_ids=tuple(97 + i for i in range(len(versions))),
        logprobs=tuple(-0.25 * (i + 1) for i in range(len(versions))),
        weight_versions=versions,
    )
    first = await turns.add_turn(episode, prompt, policy)
    env_turn = await turns.add_turn(
        episode, first, TurnRecord(kind="env", token_ids=(10,), text="\n", reward=0.5)
    )
    ids = [prompt, first, env_turn]
    if branch:
        ids.append(await turns.add_turn(episode, prompt, policy))
    await turns.complete_episode(episode, status, reward if status == "completed" else None)  # type: ignore[arg-type]
    return episode, ids


async def test_without_the_key_everything_is_401(
    gateway: tuple[httpx.AsyncClient, Any],
) -> None:
    client, app = gateway
    run_id = await _run(app)
    page = await client.get("/ui")
    assert page.status_code == 401
    assert page.headers["content-type"].startswith("text/html")
    assert 'action="/ui/login"' in page.text  # the sign-in form
    for path in (
        "/ui/api/runs",
        f"/ui/api/runs/{run_id}",
        f"/ui/api/runs/{run_id}/episodes",
        f"/ui/api/episodes/{uuid.uuid4()}",
        "/ui/api/envs",
        "/ui/api/engines",
        f"/ui/api/blobs/{'0' * 64}",
        "/ui/static/app.js",
    ):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            answer = await client.get(path, headers=headers)
            assert answer.status_code == 401, path
            assert answer.json()["error"] == "Unauthorized"
        assert (await client.get(path, headers=AUTH)).status_code in (200, 404), path
    assert (await client.get("/ui", headers=AUTH)).status_code == 200


async def test_signing_in_sets_a_cookie_that_opens_the_page_and_its_data(
    gateway: tuple[httpx.AsyncClient, Any],
) -> None:
    client, _ = gateway
    wrong = await client.post("/ui/login", content="key=nope", headers=_form())
    assert wrong.status_code == 401 and "not the key" in wrong.text
    for garbage in (b"", b"a=1&b=2&c=3&d=4&e=5&key=x", b"\xff\x00key=%ZZ", b'{"key": 1}'):
        refused = await client.post("/ui/login", content=garbage, headers=_form())
        assert refused.status_code == 401 and 'action="/ui/login"' in refused.text
    assert "agentflow_ui" not in wrong.cookies
    right = await client.post("/ui/login", content=f"key={KEY}", headers=_form())
    assert right.status_code == 303 and right.headers["location"] == "/ui"
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert KEY not in cookie  # a MAC of the key, not the key
    page = await client.get("/ui")  # the client keeps the cookie
    assert page.status_code == 200 and 'src="/ui/static/app.js"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert (await client.get("/ui/api/runs")).status_code == 200
    assert (
        (await client.get("/ui/static/app.js"))
        .headers["content-type"]
        .startswith("text/javascript")
    )
    # Not a door to the rest of the API: that still wants the key itself.
    assert (await client.get("/v1/runs")).status_code == 401
    client.cookies.set("agentflow_ui", "forged", path="/ui")
    assert (await client.get("/ui/api/runs")).status_code == 401
    await client.post("/ui/logout")
    assert (await client.get("/ui")).status_code == 401


def _form() -> dict[str, str]:
    return {"content-type": "application/x-www-form-urlencoded"}


async def test_without_a_key_the_dashboard_is_open(sqlite_database: str) -> None:
    app = create_app(Settings(database_url=sqlite_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            assert (await client.get("/ui")).status_code == 200
            assert (await client.get("/ui/api/runs")).status_code == 200


async def test_a_runs_episodes_are_paged_and_filtered(
    gateway: tuple[httpx.AsyncClient, Any],
) -> None:
    client, app = gateway
    turns: TurnTree = app.state.turn_tree
    run_id = await _run(app)
    other = await _run(app, "other")
    await _episode(turns, other)  # another run's episode is never listed
    made = []
    for i in range(7):
        episode, _ = await _episode(
            turns,
            run_id,
            env="agentflow/vault-v0" if i % 2 else "agentflow/count-v0",
            versions=(i, i + 1),
            reward=float(i),
            status="completed" if i < 5 else "failed",
        )
        made.append(episode)
    url = f"/ui/api/runs/{run_id}/episodes"

    async def ids(**query: Any) -> tuple[list[str], int]:
        body = (await client.get(url, params=query, headers=AUTH)).json()
        return [e["id"] for e in body["items"]], body["total"]

    newest_first = [str(e) for e in reversed(made)]
    assert await ids() == (newest_first, 7)
    assert await ids(limit=3, offset=3) == (newest_first[3:6], 7)
    assert await ids(status="failed") == (newest_first[:2], 2)
    assert (await ids(env="agentflow/count-v0"))[1] == 4
    assert await ids(reward_min=2, reward_max=3) == ([str(made[3]), str(made[2])], 2)
    # Version 3 was sampled in episodes 2 (versions 2..3) and 3 (3..4).
    assert await ids(weight_version=3) == ([str(made[3]), str(made[2])], 2)
    first = (await client.get(url, params={"limit": 1}, headers=AUTH)).json()["items"][0]
    assert (first["min_weight_version"], first["max_weight_version"]) == (6, 7)
    assert first["turns"] == 3 and first["status"] == "failed"
    for query, field in (
        ({"reward_min": "nan"}, "reward_min"),
        ({"weight_version": "-1"}, "weight_version"),
        ({"status": "bogus"}, "status"),
        ({"limit": "0"}, "limit"),
    ):
        answer = await client.get(url, params=query, headers=AUTH)
        assert answer.status_code == 422
        assert answer.json()["detail"][0]["loc"] == ["query", field]
    missing = await client.get(f"/ui/api/runs/{uuid.uuid4()}/episodes", headers=AUTH)
    assert missing.status_code == 404


async def test_a_run_has_a_curve_point_per_step(gateway: tuple[httpx.AsyncClient, Any]) -> None:
    client, app = gateway
    run_id = await _run(app)
    runs = RunStore(app.state.sessionmaker)
    await runs.record_version(run_id, 0, "", {})
    for version in (1, 2, 3):
        await runs.record_version(run_id, version, "", {"switch_seconds": 0.1})
        metrics = {"reward": version / 10, "staleness_mean": 0.5, "trajectories": 8.0}
        await runs.record_metrics(run_id, version, metrics)
    run = (await client.get(f"/ui/api/runs/{run_id}", headers=AUTH)).json()
    series = run["curves"]["series"]
    assert run["curves"]["steps"] == 3
    assert series["reward"] == [[1, 0.1], [2, 0.2], [3, pytest.approx(0.3)]]
    assert [p[0] for p in series["throughput"]] == [1, 2, 3]
    assert all(p[1] > 0 for p in series["throughput"])
    listed = (await client.get("/ui/api/runs", headers=AUTH)).json()["items"]
    (mine,) = [r for r in listed if r["id"] == str(run_id)]
    assert mine["weight_version"] == 3 and mine["status"] == "stopped"


async def test_an_episode_is_its_tree_with_each_tokens_text(
    gateway: tuple[httpx.AsyncClient, Any],
) -> None:
    client, app = gateway
    run_id = await _run(app)
    episode, (prompt, first, env_turn, sibling) = await _episode(
        app.state.turn_tree, run_id, branch=True
    )
    body = (await client.get(f"/ui/api/episodes/{episode}", headers=AUTH)).json()
    assert body["run_name"] == "ui" and body["live"] is False
    (root,) = body["roots"]
    assert root["id"] == str(prompt)
    assert root["token_texts"] == ["H", "i"]
    assert [c["id"] for c in root["children"]] == [str(first), str(sibling)]  # a fork
    policy = root["children"][0]
    assert policy["token_texts"] == ["a", "b"]
    assert policy["logprobs"] == [-0.25, -0.5] and policy["weight_versions"] == [1, 2]
    (env,) = policy["children"]
    assert env["id"] == str(env_turn) and env["token_texts"] == ["\n"] and env["reward"] == 0.5
    # Both leaves became trajectories.
    assert env["is_trajectory"] and root["children"][1]["is_trajectory"]
    assert not policy["is_trajectory"]
    assert ByteTokenizer().decode([72]) == "H"


async def test_envs_show_their_live_sessions(gateway: tuple[httpx.AsyncClient, Any]) -> None:
    client, app = gateway
    name = f"web-form-{uuid.uuid4().hex[:8]}"
    spec = {"name": name, "kind": "http", "spec": {"url": "http://127.0.0.1:9000"}}
    env = (await client.post("/v1/envs", json=spec, headers=AUTH)).json()
    run_id = await _run(app)
    turns: TurnTree = app.state.turn_tree
    for _ in range(2):
        await turns.create_episode(
            run_id=run_id, environment_id=uuid.UUID(env["id"]), env_ref=env["id"]
        )
    builtin = f"agentflow/unregistered-{uuid.uuid4().hex[:8]}"
    await turns.create_episode(run_id=run_id, env_ref=builtin)
    body = (await client.get("/ui/api/envs", headers=AUTH)).json()
    (listed,) = [e for e in body["items"] if e["name"] == name]
    assert listed["live_sessions"] == 2
    assert listed["kind"] == "http" and listed["max_concurrency"] == 64
    assert {"env_ref": builtin, "live_sessions": 1} in body["unregistered"]
    assert env["id"] not in [e["env_ref"] for e in body["unregistered"]]
    assert (await client.get("/ui/api/engines", headers=AUTH)).json() == {"items": []}


async def test_without_its_tokenizer_an_episode_still_shows(
    gateway: tuple[httpx.AsyncClient, Any], tmp_path: Any
) -> None:
    """A run whose checkpoint is gone: token ids and the stored text, no error."""
    client, app = gateway
    runs = RunStore(app.state.sessionmaker)
    config = {**CONFIG, "name": "moved", "model": {"path": str(tmp_path / "moved-away")}}
    run_id = await runs.create("moved", config)
    episode, _ = await _episode(app.state.turn_tree, run_id)
    answer = await client.get(f"/ui/api/episodes/{episode}", headers=AUTH)
    assert answer.status_code == 200
    (root,) = answer.json()["roots"]
    assert root["token_texts"] is None and root["token_ids"] == [72, 105]
    assert root["children"][0]["children"][0]["text"] == "\n"
