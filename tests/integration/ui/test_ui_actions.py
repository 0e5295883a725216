"""The dashboard's run controls (pause, resume, stop, the env mix) on both databases:
only from the dashboard's own page (its token and its Origin), logged with who and when;
and each env's curves with the mix's revisions."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.app import create_app
from agentflow.config import Settings
from agentflow.db.runs import RunStore
from agentflow.ui.app import create_dashboard_app

pytestmark = pytest.mark.integration

KEY = "s3cret"
OWN = "http://gateway"  # the origin the test client's requests come from
TINY_MODEL = {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}}
GUESS, VAULT = "agentflow/guess-number-v0", "agentflow/vault-v0"


@pytest.fixture
async def signed_in(database_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """A browser-like client: signed in at /ui, so it holds the session cookie."""
    app = create_app(Settings(database_url=database_url, api_key=KEY))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=OWN) as client:
            form = {"content-type": "application/x-www-form-urlencoded"}
            assert (
                await client.post("/ui/login", content=f"key={KEY}", headers=form)
            ).status_code == 303
            yield client, app


async def _live_run(client: httpx.AsyncClient) -> str:
    config = {
        "name": f"ui-{uuid.uuid4().hex[:6]}",
        "model": TINY_MODEL,
        "envs": [{"id": GUESS, "max_concurrency": 4}],
        "agent": {"max_turns": 2, "max_new_tokens": 4},
        "rollout": {"group_size": 2, "max_concurrency": 4},
    }
    created = await client.post("/v1/runs", json=config, headers={"Authorization": f"Bearer {KEY}"})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def test_actions_need_the_pages_token_and_origin(
    signed_in: tuple[httpx.AsyncClient, Any], caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = signed_in
    run_id = await _live_run(client)
    session = (await client.get("/ui/api/session")).json()
    assert session["controls"] is True and len(session["csrf_token"]) == 64
    good = {"Origin": OWN, "X-CSRF-Token": session["csrf_token"]}
    pause = f"/ui/api/runs/{run_id}/pause"

    # What another site can make a browser send: the cookie, and its own (or no) Origin.
    for headers in (
        {},
        {"Origin": "https://evil.example"},
        {"Origin": OWN},
        {"Origin": OWN, "X-CSRF-Token": "0" * 64},
        {"Origin": "https://evil.example", "X-CSRF-Token": session["csrf_token"]},
        {"X-CSRF-Token": session["csrf_token"]},
    ):
        refused = await client.post(pause, headers=headers)
        assert refused.status_code == 403, (headers, refused.text)
    mix_change = {"set": [{"id": VAULT}]}
    refused = await client.patch(
        f"/ui/api/runs/{run_id}/envs", json=mix_change, headers={"Origin": "https://evil.example"}
    )
    assert refused.status_code == 403
    assert (await client.get(f"/ui/api/runs/{run_id}")).json()["status"] == "running"

    caplog.set_level(logging.INFO, logger="agentflow.ui.routes")
    paused = await client.post(pause, headers=good)
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    resumed = await client.post(f"/ui/api/runs/{run_id}/resume", headers=good)
    assert resumed.json()["status"] == "running"
    changed = await client.patch(
        f"/ui/api/runs/{run_id}/envs", json={"revision": 0, **mix_change}, headers=good
    )
    assert changed.status_code == 200, changed.text
    detail = changed.json()
    assert detail["mix"]["revision"] == 1
    assert [e["id"] for e in detail["mix"]["envs"]] == [GUESS, VAULT]
    assert detail["env_revisions"][-1]["changed_by"] == "dashboard from 127.0.0.1"
    bad = await client.patch(
        f"/ui/api/runs/{run_id}/envs", json={"set": [{"id": VAULT, "weight": 0}]}, headers=good
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:3] == ["body", "set", 0]
    stale = await client.patch(
        f"/ui/api/runs/{run_id}/envs", json={"revision": 0, **mix_change}, headers=good
    )
    assert stale.status_code == 409
    stopped = await client.post(f"/ui/api/runs/{run_id}/stop", headers=good)
    assert stopped.json()["status"] == "stopped"
    logged = [r.getMessage() for r in caplog.records if r.name == "agentflow.ui.routes"]
    for action in ("pause", "resume", "env mix revision 1", "stop"):
        assert any(
            action in line and "by dashboard from 127.0.0.1 at 20" in line for line in logged
        ), (action, logged)
    unknown = await client.post(f"/ui/api/runs/{run_id}/restart", headers=good)
    assert unknown.status_code == 422


async def test_the_api_key_as_a_header_needs_no_page_token(
    signed_in: tuple[httpx.AsyncClient, Any],
) -> None:
    client, _ = signed_in
    run_id = await _live_run(client)
    client.cookies.clear()
    assert (await client.post(f"/ui/api/runs/{run_id}/pause")).status_code == 401
    keyed = await client.post(
        f"/ui/api/runs/{run_id}/pause", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert keyed.status_code == 200 and keyed.json()["status"] == "paused"
    await client.post(f"/v1/runs/{run_id}/stop", headers={"Authorization": f"Bearer {KEY}"})


async def test_a_dashboard_without_a_manager_shows_but_does_not_control(
    database_url: str,
) -> None:
    app = create_app(Settings(database_url=database_url))
    async with app.router.lifespan_context(app):
        board = create_dashboard_app(app.state.settings, app.state.turn_tree, RuntimeRegistry())
        transport = httpx.ASGITransport(app=board)
        async with httpx.AsyncClient(transport=transport, base_url=OWN) as client:
            session = (await client.get("/ui/api/session")).json()
            assert session["controls"] is False
            headers = {"Origin": OWN, "X-CSRF-Token": session["csrf_token"]}
            refused = await client.post(f"/ui/api/runs/{uuid.uuid4()}/pause", headers=headers)
            assert refused.status_code == 409 and "does not control" in refused.text
            assert (await client.get(f"/v1/runs/{uuid.uuid4()}")).status_code == 404


async def test_each_env_has_its_curves_with_the_mix_revisions(
    signed_in: tuple[httpx.AsyncClient, Any],
) -> None:
    client, app = signed_in
    runs = RunStore(app.state.sessionmaker)
    run_id = await runs.create("curves", {"name": "curves", "envs": [{"id": GUESS}]})
    await runs.set_status(run_id, "running")
    for version in (1, 2, 3, 4):
        await runs.record_version(run_id, version, "", {})
        metrics = {"reward": 0.5, f"env/{GUESS}/reward": version / 10}
        metrics[f"env/{GUESS}/episodes"] = 8.0
        if version >= 3:  # the vault joined after version 2
            metrics[f"env/{VAULT}/reward"] = version / 100
            metrics[f"env/{VAULT}/staleness"] = 0.5
        await runs.record_metrics(run_id, version, metrics, step=version)
    stored = await runs.get(run_id)
    config = {**stored.config, "envs": [{"id": GUESS}, {"id": VAULT}]}
    await runs.revise_envs(run_id, seen=0, config=config, weight_version=2, changed_by="test")

    run = (await client.get(f"/ui/api/runs/{run_id}")).json()
    assert run["env_curves"][GUESS]["reward"] == [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.4]]
    assert run["env_curves"][GUESS]["episodes"] == [[v, 8.0] for v in (1, 2, 3, 4)]
    assert run["env_curves"][VAULT] == {
        "reward": [[3, 0.03], [4, 0.04]],
        "staleness": [[3, 0.5], [4, 0.5]],
    }
    assert [(r["revision"], r["weight_version"]) for r in run["env_revisions"]] == [(0, 0), (1, 2)]
    assert run["mix"] == {"revision": 1, "envs": config["envs"]}

    api = await client.get(f"/v1/runs/{run_id}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    body = api.json()
    assert body["envs"] == run["env_curves"]
    assert [r["revision"] for r in body["env_revisions"]] == [0, 1]
    await runs.set_status(run_id, "stopped")
