from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.api.schemas.runs import RunPublic
from agentflow.client import AsyncClient
from agentflow.db.models import Run
from agentflow.errors import Conflict, InvalidInput, NotFound
from tests.unit.test_run_config import BASE, NOT_AVAILABLE, REFUSED

pytestmark = pytest.mark.integration


async def _env(api: AsyncClient) -> str:
    env = await api.create_env(
        {"name": f"env-{uuid.uuid4().hex[:8]}", "kind": "http", "spec": {"url": "http://a"}}
    )
    return env.name


async def test_create_get_list(api: AsyncClient) -> None:
    env = await _env(api)
    run = await api.create_run(
        {"name": "r1", "envs": [{"id": env}], "trainer": {"lr": 1e-3}}, start=False
    )
    assert run.status == "pending" and run.weight_version == 0
    assert run.config["trainer"]["lr"] == 1e-3
    assert run.config["rollout"]["max_staleness"] == 2  # defaults are stored explicitly
    detail = await api.get_run(run.id)
    assert RunPublic.model_validate(detail.model_dump()) == run
    assert detail.envs == run.config["envs"] and detail.env_revision == 0
    (first,) = detail.env_revisions  # the mix as created
    assert (first.revision, first.envs) == (0, run.config["envs"])
    assert first.changed_by == "created"
    assert run.id in [r.id for r in (await api.list_runs(status="pending", limit=500)).items]
    with pytest.raises(NotFound):
        await api.get_run(uuid.uuid4())


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"envs": [{"id": "x"}]}, ["body", "name"]),
        ({"name": "r", "envs": []}, ["body", "envs"]),
        ({"name": "r", "envs": [{"id": "x", "weight": 0}]}, ["body", "envs", 0, "weight"]),
        (
            {"name": "r", "envs": [{"id": "e"}], "rollout": {"max_staleness": -1}},
            ["body", "rollout", "max_staleness"],
        ),
        (
            {"name": "r", "envs": [{"id": "e"}], "trainer": {"algorithm": "dqn"}},
            ["body", "trainer", "algorithm"],
        ),
        (
            {"name": "r", "envs": [{"id": "e"}], "engine": {"type": "sglang"}},
            ["body", "engine"],
        ),
        ({"name": "r", "envs": [{"id": "e"}], "bogus": 1}, ["body", "bogus"]),
        (
            {"name": "r", "envs": [{"id": "e"}], "rollout": {"interrupt": "pause"}},
            ["body", "rollout", "interrupt"],
        ),
        (
            {"name": "r", "envs": [{"id": "e"}], "rollout": {"max_reuse": 0}},
            ["body", "rollout", "max_reuse"],
        ),
        (
            {"name": "r", "envs": [{"id": "e"}], "rollout": {"group_size": 0}},
            ["body", "rollout", "group_size"],
        ),
        (
            {
                "name": "r",
                "envs": [{"id": "e"}],
                "rollout": {"elastic": True, "min_concurrency": 9, "max_concurrency": 8},
            },
            ["body", "rollout"],
        ),
        (
            {"name": "r", "envs": [{"id": "e"}], "trainer": {"checkpoint_every": 0}},
            ["body", "trainer", "checkpoint_every"],
        ),
    ],
)
async def test_bad_config_names_the_field(
    http: httpx.AsyncClient, body: dict[str, object], loc: list[object]
) -> None:
    response = await http.post("/v1/runs", json=body, params={"start": "false"})
    assert response.status_code == 422, response.text
    assert loc in [d["loc"] for d in response.json()["detail"]]


@pytest.mark.parametrize(("patch", "loc"), NOT_AVAILABLE, ids=lambda v: str(v))
async def test_planned_options_are_refused_naming_the_field(
    http: httpx.AsyncClient, patch: dict[str, Any], loc: tuple[str | int, ...]
) -> None:
    response = await http.post("/v1/runs", json={**BASE, **patch}, params={"start": "false"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [d["loc"] for d in detail] == [["body", *loc]]
    assert "is not available yet" in detail[0]["msg"]


@pytest.mark.parametrize(("patch", "loc", "says"), REFUSED, ids=lambda v: str(v))
async def test_options_that_would_do_nothing_are_refused_naming_the_field(
    http: httpx.AsyncClient, patch: dict[str, Any], loc: tuple[str | int, ...], says: str
) -> None:
    response = await http.post("/v1/runs", json={**BASE, **patch}, params={"start": "false"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [d["loc"] for d in detail] == [["body", *loc]]
    assert says in detail[0]["msg"]


async def test_unknown_env_is_refused(api: AsyncClient) -> None:
    with pytest.raises(InvalidInput) as info:
        await api.create_run({"name": "r", "envs": [{"id": "no-such-env"}]}, start=False)
    assert info.value.field == ("body", "envs", "0", "id")


async def test_env_used_by_active_run_cannot_be_deleted(
    api: AsyncClient, db_engine: AsyncEngine
) -> None:
    env_name = await _env(api)
    env = (await api.list_envs(name=env_name)).items[0]
    run = await api.create_run(
        {"name": "r", "envs": [{"id": f"{env_name}@{env.version}"}]}, start=False
    )
    async with db_engine.begin() as conn:
        await conn.execute(update(Run).where(Run.id == run.id).values(status="running"))
    with pytest.raises(Conflict):
        await api.delete_env(env.id)
    async with db_engine.begin() as conn:
        await conn.execute(update(Run).where(Run.id == run.id).values(status="finished"))
    await api.delete_env(env.id)
    assert (await api.get_run(run.id)).config["envs"][0]["id"].startswith(env_name)


async def test_builtin_env_ids_need_no_registration(api: AsyncClient) -> None:
    run = await api.create_run(
        {"name": "quick", "envs": [{"id": "agentflow/guess-number-v0"}]}, start=False
    )
    assert run.config["envs"][0]["id"] == "agentflow/guess-number-v0"
    with pytest.raises(InvalidInput):
        await api.create_run(
            {"name": "quick", "envs": [{"id": "agentflow/no-such-v0"}]}, start=False
        )


async def test_kwargs_for_a_registered_env_are_refused(api: AsyncClient) -> None:
    env_name = await _env(api)
    with pytest.raises(InvalidInput) as info:
        await api.create_run(
            {"name": "r", "envs": [{"id": env_name, "kwargs": {"low": 3}}]}, start=False
        )
    assert info.value.field == ("body", "envs", "0", "kwargs")


async def test_the_gateway_refuses_a_warm_start(http: httpx.AsyncClient) -> None:
    body = {**BASE, "warm_start": {"enabled": True}}
    response = await http.post("/v1/runs", json=body, params={"start": "false"})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "warm_start", "enabled"]
    assert "agentflow sft" in detail["msg"]


async def test_plugins_come_from_allowed_modules_only(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {
        **BASE,
        "envs": [{"id": BASE["envs"][0]["id"], "reward": "tests.support.plugins:text_length"}],
        "rollout": {"hooks": ["tests.support.plugins:record_event"]},
    }
    response = await http.post("/v1/runs", json=body, params={"start": "false"})
    assert response.status_code == 422, response.text
    assert [d["loc"] for d in response.json()["detail"]] == [
        ["body", "envs", 0, "reward"],
        ["body", "rollout", "hooks", 0],
    ]
    assert "not on the plug-in allow-list" in response.json()["detail"][0]["msg"]
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "tests.support")
    response = await http.post("/v1/runs", json=body, params={"start": "false"})
    assert response.status_code == 201, response.text
    config = response.json()["config"]
    assert config["envs"][0]["reward"] == "tests.support.plugins:text_length"
    assert config["rollout"]["hooks"] == ["tests.support.plugins:record_event"]


async def test_an_agent_factory_that_makes_no_agent_fails_the_start(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "tests.support")
    name = f"no-agent-{uuid.uuid4().hex[:8]}"
    agent = {"type": "python", "entry_point": "tests.support.plugins:not_an_agent"}
    response = await http.post("/v1/runs", json={**BASE, "name": name, "agent": agent})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "agent", "entry_point"]
    assert "returned an instance of 'object', which has no async run(episode)" in detail["msg"]
    (run,) = (await http.get("/v1/runs", params={"name": name})).json()["items"]
    assert run["status"] == "failed" and "has no async run(episode)" in run["error"]
