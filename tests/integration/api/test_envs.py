from __future__ import annotations

import uuid

import httpx
import pytest

from agentflow.client import AsyncClient
from agentflow.errors import Conflict, InvalidInput, NotFound

pytestmark = pytest.mark.integration


def _name() -> str:
    return f"env-{uuid.uuid4().hex[:8]}"


def _http_env(name: str, **extra: object) -> dict[str, object]:
    return {"name": name, "kind": "http", "spec": {"url": "http://127.0.0.1:9000"}, **extra}


def _locs(response: httpx.Response) -> list[list[object]]:
    assert response.status_code == 422, response.text
    return [d["loc"] for d in response.json()["detail"]]


async def test_register_get_list_patch_delete(api: AsyncClient) -> None:
    name = _name()
    created = await api.create_env(
        {
            **_http_env(name, version="2", max_concurrency=8, step_timeout_s=5),
            "tools": [{"type": "function", "function": {"name": "lookup"}}],
            "description": "a test env",
        }
    )
    assert (created.name, created.version, created.kind) == (name, "2", "http")
    assert created.spec["url"] == "http://127.0.0.1:9000/"
    assert created.tools[0]["function"]["name"] == "lookup"

    assert (await api.get_env(created.id)) == created
    page = await api.list_envs(name=name)
    assert [e.id for e in page.items] == [created.id] and page.total == 1
    assert (await api.list_envs(name=name, kind="python")).total == 0

    patched = await api.update_env(created.id, {"max_concurrency": 3, "description": "new"})
    assert (patched.max_concurrency, patched.description) == (3, "new")
    assert patched.spec == created.spec

    await api.delete_env(created.id)
    with pytest.raises(NotFound):
        await api.get_env(created.id)


async def test_same_name_and_version_conflicts(api: AsyncClient) -> None:
    name = _name()
    await api.create_env(_http_env(name))
    with pytest.raises(Conflict):
        await api.create_env(_http_env(name))
    other = await api.create_env(_http_env(name, version="2"))  # a new version is fine
    assert other.version == "2"


async def test_paging(api: AsyncClient) -> None:
    kind_name = _name()
    ids = [(await api.create_env(_http_env(kind_name, version=str(v)))).id for v in range(5)]
    first = await api.list_envs(name=kind_name, limit=2, offset=0)
    rest = await api.list_envs(name=kind_name, limit=10, offset=2)
    assert first.total == rest.total == 5
    assert [e.id for e in first.items + rest.items] == ids


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"name": "x", "kind": "quantum", "spec": {}}, ["body", "kind"]),
        ({"name": "x", "kind": "python", "spec": {}}, ["body", "spec", "entry_point"]),
        (
            {"name": "x", "kind": "python", "spec": {"entry_point": "no colon"}},
            ["body", "spec", "entry_point"],
        ),
        ({"name": "x", "kind": "http", "spec": {"url": "not a url"}}, ["body", "spec", "url"]),
        ({"name": "x", "kind": "container", "spec": {"image": "i"}}, ["body", "spec", "command"]),
        (
            {"name": "x", "kind": "http", "spec": {"url": "http://a", "extra": 1}},
            ["body", "spec", "extra"],
        ),
        (_http_env("x", max_concurrency=-1), ["body", "max_concurrency"]),
        (_http_env("x", step_timeout_s=0), ["body", "step_timeout_s"]),
        (_http_env("bad name!"), ["body", "name"]),
        ({"kind": "http", "spec": {"url": "http://a"}}, ["body", "name"]),
    ],
)
async def test_bad_input_names_the_field(
    http: httpx.AsyncClient, body: dict[str, object], loc: list[object]
) -> None:
    assert loc in _locs(await http.post("/v1/envs", json=body))


async def test_oversized_body_is_refused(http: httpx.AsyncClient) -> None:
    body = _http_env(_name(), description="x" * 100_000)
    assert _locs(await http.post("/v1/envs", json=body)) == [["body"]]


async def test_chunked_oversized_body_is_refused(http: httpx.AsyncClient) -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(100):
            yield b"x" * 1024

    response = await http.post(
        "/v1/envs", content=chunks(), headers={"content-type": "application/json"}
    )
    assert _locs(response) == [["body"]]


async def test_patch_validates_spec_against_kind(api: AsyncClient) -> None:
    env = await api.create_env(_http_env(_name()))
    with pytest.raises(InvalidInput) as info:
        await api.update_env(env.id, {"spec": {"entry_point": "a.b:c"}})
    assert info.value.field[:2] == ("body", "spec")
    with pytest.raises(InvalidInput):
        await api.update_env(env.id, {"name": "renamed"})
    assert (await api.get_env(env.id)).spec == env.spec


async def test_unknown_ids(http: httpx.AsyncClient) -> None:
    missing = uuid.uuid4()
    assert (await http.get(f"/v1/envs/{missing}")).status_code == 404
    assert (await http.patch(f"/v1/envs/{missing}", json={})).status_code == 404
    assert (await http.delete(f"/v1/envs/{missing}")).status_code == 404
    assert (await http.get("/v1/envs/not-a-uuid")).status_code == 422
