from __future__ import annotations

import uuid

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.client import AsyncClient
from agentflow.db.models import Run
from agentflow.errors import Conflict, InvalidInput, NotFound

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
    assert (await api.get_run(run.id)) == run
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
            ["body", "engine", "sglang", "urls"],
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
