"""A live run's env mix changed through `PATCH /v1/runs/{id}` (real LocalEngine, both
databases): the next groups follow the new mix, the episodes in flight finish in the env
they started in, each change is a revision, a restart resumes the newest, and bad
changes are refused naming the field."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from agentflow.api.schemas.runs import EpisodePublic
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.errors import Conflict
from envs import registry
from tests.integration.rollout.gateway import serve_gateway, until
from tests.integration.rollout.scripted_envs import GatedEnv, SlowEnv

pytestmark = pytest.mark.integration

TINY_MODEL = {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 512}}
A, B, C = "test/MixA-v0", "test/MixB-v0", "test/MixC-v0"


@pytest.fixture(autouse=True)
def mix_envs() -> Iterator[None]:
    for env_id in (A, B):
        registry.register(env_id, GatedEnv, replace=True)
    registry.register(C, SlowEnv, replace=True)
    GatedEnv.gate = asyncio.Event()
    GatedEnv.gate.set()
    yield
    for env_id in (A, B, C):
        registry.unregister(env_id)
    GatedEnv.gate = None


def _config(*envs: dict[str, Any], **rollout: Any) -> dict[str, Any]:
    return {
        "name": f"mix-{uuid.uuid4().hex[:6]}",
        "model": TINY_MODEL,
        "envs": list(envs),
        "agent": {"max_turns": 2, "max_new_tokens": 4},
        "rollout": {
            "group_size": 2,
            "max_concurrency": 2,
            "wait_for_trainer": False,
            **rollout,
        },
    }


def _env(env_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": env_id, "kwargs": {"delay": 0.0, "steps": 1}, **fields}


async def _episodes(api: AsyncClient, run_id: uuid.UUID) -> list[EpisodePublic]:
    return (await api.list_run_episodes(run_id, limit=1000)).items


def _groups(episodes: list[EpisodePublic], after: datetime | None = None) -> list[list[str]]:
    """Each group's envs, in the order the groups started (their first episode)."""
    first: dict[str, datetime] = {}
    envs: dict[str, list[str]] = {}
    for e in sorted(episodes, key=lambda e: e.created_at):
        assert e.group_id is not None
        first.setdefault(e.group_id, e.created_at)
        envs.setdefault(e.group_id, []).append(e.env_ref)
    order = sorted(first, key=lambda g: first[g])
    return [envs[g] for g in order if after is None or first[g] > after]


async def _stop(api: AsyncClient, run_id: uuid.UUID) -> None:
    assert GatedEnv.gate is not None
    GatedEnv.gate.set()
    await api.stop_run(run_id)


async def test_added_removed_and_reweighted_envs_apply_to_the_next_groups(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
) -> None:
    api, _ = gateway
    assert GatedEnv.gate is not None
    GatedEnv.gate.clear()  # A's first group is held in its env while the mix changes
    run = await api.create_run(_config(_env(A)))

    async def first_group_waits() -> bool:
        return GatedEnv.waiting == 2

    await until(first_group_waits)
    held = {e.id for e in await _episodes(api, run.id)}
    assert len(held) == 2

    # Add B, then take A out: the groups admitted from here on play B alone.
    added = await api.change_run_envs(run.id, {"set": [{"id": B, "kwargs": {"steps": 1}}]})
    assert added.env_revision == 1 and [e["id"] for e in added.envs] == [A, B]
    removed = await api.change_run_envs(run.id, {"remove": [A], "revision": 1})
    assert removed.env_revision == 2 and [e["id"] for e in removed.envs] == [B]
    changed_at = removed.env_revisions[-1].created_at
    GatedEnv.gate.set()

    async def groups_after(n: int) -> bool:
        return len(_groups(await _episodes(api, run.id), after=changed_at)) >= n

    await until(lambda: groups_after(5))
    episodes = await _episodes(api, run.id)
    # The episodes in flight finished in A, as they started, and were not cut short.
    for e in episodes:
        if e.id in held:
            assert e.env_ref == A
            if e.status != "running":
                assert e.status in ("completed", "truncated"), e
    # At most the group already admitted (waiting for slots) still plays A; every group
    # admitted after the change plays B, whole.
    after = _groups(episodes, after=changed_at)
    assert all(len(set(g)) == 1 for g in after)
    assert [g[0] for g in after[1:]] == [B] * (len(after) - 1), after

    # Reweight: A back at 1, B at 3; from the next group on, every 4 groups hold 1 A.
    reweighted = await api.change_run_envs(
        run.id, {"set": [{"id": A, "weight": 1}, {"id": B, "weight": 3, "max_concurrency": 4}]}
    )
    assert reweighted.env_revision == 3
    assert {e["id"]: e["weight"] for e in reweighted.envs} == {B: 3.0, A: 1.0}
    assert {e["id"]: e["max_concurrency"] for e in reweighted.envs}[B] == 4
    reweighted_at = reweighted.env_revisions[-1].created_at

    async def groups_reweighted(n: int) -> bool:
        return len(_groups(await _episodes(api, run.id), after=reweighted_at)) >= n

    await until(lambda: groups_reweighted(9))
    later = _groups(await _episodes(api, run.id), after=reweighted_at)[1:9]
    assert len(later) == 8 and sum(g[0] == A for g in later) == 2, later

    detail = await api.get_run(run.id)
    assert [r.revision for r in detail.env_revisions] == [0, 1, 2, 3]
    assert [[e["id"] for e in r.envs] for r in detail.env_revisions] == [[A], [A, B], [B], [B, A]]
    assert all(r.changed_by.startswith("api from ") for r in detail.env_revisions[1:])
    assert detail.env_revisions[0].changed_by == "created"
    assert all(r.weight_version == 0 for r in detail.env_revisions)  # no trainer here
    await _stop(api, run.id)
    assert not [e for e in await _episodes(api, run.id) if e.status in ("pending", "running")]


async def test_a_restart_resumes_the_newest_revision(settings: Settings) -> None:
    async with serve_gateway(settings) as (api, _):
        run = await api.create_run(_config(_env(A), max_episodes=40))
        await api.change_run_envs(run.id, {"set": [{"id": C, "kwargs": {"delay": 0.01}}]})
        await api.change_run_envs(run.id, {"remove": [A]})
        assert GatedEnv.gate is not None
        GatedEnv.gate.clear()  # held: the gateway shuts down with episodes live

    async with serve_gateway(settings) as (restarted, _):  # the restart
        restarted_at = datetime.now().astimezone()
        assert GatedEnv.gate is not None
        GatedEnv.gate.set()

        async def finished() -> bool:
            return (await restarted.get_run(run.id)).status == "finished"

        await until(finished)
        detail = await restarted.get_run(run.id)
        assert detail.env_revision == 2 and [e["id"] for e in detail.envs] == [C]
        after = _groups(await _episodes(restarted, run.id), after=restarted_at)
        assert after and all(set(g) == {C} for g in after), after


@pytest.mark.parametrize(
    ("change", "loc", "says"),
    [
        ({"set": [{"id": "no/Such-v0"}]}, ["body", "set", "0", "id"], "unknown environment"),
        ({"set": [{"id": A, "weight": 0}]}, ["body", "set", 0, "weight"], "greater than 0"),
        ({"set": [{"id": A, "weight": -2}]}, ["body", "set", 0, "weight"], "greater than 0"),
        ({"set": [{"id": A, "weight": "inf"}]}, ["body", "set", 0, "weight"], "finite"),
        ({"set": [{"id": A, "max_concurrency": 0}]}, ["body", "set", 0, "max_concurrency"], ""),
        ({"remove": [A]}, ["body", "remove"], "at least one env"),
        ({"remove": [B]}, ["body", "remove", "0"], "not in the run's mix"),
        ({"envs": []}, ["body", "envs"], "at least 1"),
        ({}, ["body"], "nothing to change"),
        ({"envs": [{"id": A}], "remove": [A]}, ["body"], "not both"),
        ({"set": [{"id": A}], "remove": [A]}, ["body", "set", "0", "id"], "both set and removed"),
        ({"revision": -1, "remove": [A]}, ["body", "revision"], ""),
        ({"bogus": 1, "remove": [A]}, ["body", "bogus"], ""),
    ],
    ids=lambda v: str(v),
)
async def test_bad_changes_are_refused_naming_the_field(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
    change: dict[str, Any],
    loc: list[object],
    says: str,
) -> None:
    api, raw = gateway
    run = await api.create_run(_config(_env(A)), start=False)
    response = await raw.patch(f"/v1/runs/{run.id}", json=change)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert loc in [d["loc"] for d in detail], detail
    assert says in detail[0]["msg"]
    unchanged = await api.get_run(run.id)
    assert unchanged.env_revision == 0 and unchanged.envs == run.config["envs"]


async def test_a_registered_env_keeps_its_spec(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
) -> None:
    api, raw = gateway
    name = f"reg-{uuid.uuid4().hex[:8]}"
    await api.create_env({"name": name, "kind": "http", "spec": {"url": "http://127.0.0.1:9"}})
    run = await api.create_run(_config(_env(A)))
    await api.pause_run(run.id)  # live, admitting nothing: the http env is never played
    response = await raw.patch(
        f"/v1/runs/{run.id}", json={"set": [{"id": name, "kwargs": {"steps": 3}}]}
    )
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "set", "0", "kwargs"] and "registered env" in error["msg"]
    # Added to a mix, a registered env is linked to the run: it cannot be deleted under it.
    other = f"reg-{uuid.uuid4().hex[:8]}"
    created = await api.create_env(
        {"name": other, "kind": "http", "spec": {"url": "http://127.0.0.1:9"}}
    )
    await api.change_run_envs(run.id, {"set": [{"id": name}, {"id": other, "weight": 2}]})
    assert (await raw.delete(f"/v1/envs/{created.id}")).status_code == 409
    await _stop(api, run.id)


async def test_an_ended_run_refuses_changes(gateway: tuple[AsyncClient, httpx.AsyncClient]) -> None:
    api, raw = gateway
    run = await api.create_run(_config(_env(A), max_episodes=2))

    async def finished() -> bool:
        return (await api.get_run(run.id)).status == "finished"

    await until(finished)
    response = await raw.patch(f"/v1/runs/{run.id}", json={"set": [{"id": B}]})
    assert response.status_code == 409 and "finished" in response.json()["detail"]
    assert (await raw.patch(f"/v1/runs/{uuid.uuid4()}", json={"remove": [A]})).status_code == 404


async def test_concurrent_changes_apply_in_order_or_are_refused_as_stale(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
) -> None:
    api, raw = gateway
    run = await api.create_run(_config(_env(A)))
    # Without a revision: both apply, one after the other, each on the mix the other left.
    await asyncio.gather(
        api.change_run_envs(run.id, {"set": [{"id": B, "weight": 2}]}),
        api.change_run_envs(run.id, {"set": [{"id": C, "weight": 3}]}),
    )
    detail = await api.get_run(run.id)
    assert detail.env_revision == 2
    assert {e["id"]: e["weight"] for e in detail.envs} == {A: 1.0, B: 2.0, C: 3.0}
    assert [len(r.envs) for r in detail.env_revisions] == [1, 2, 3]
    # Both against revision 2: one applies, the other is refused as stale.
    answers = await asyncio.gather(
        raw.patch(f"/v1/runs/{run.id}", json={"revision": 2, "remove": [B]}),
        raw.patch(f"/v1/runs/{run.id}", json={"revision": 2, "remove": [C]}),
    )
    assert sorted(a.status_code for a in answers) == [200, 409], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 409)
    assert "revision 3, not 2" in refused.json()["detail"]
    detail = await api.get_run(run.id)
    assert detail.env_revision == 3 and len(detail.envs) == 2
    with pytest.raises(Conflict):
        await api.change_run_envs(run.id, {"revision": 2, "remove": [A]})
    await _stop(api, run.id)


async def test_reading_and_changing_a_run_hold_one_pooled_connection(
    gateway: tuple[AsyncClient, httpx.AsyncClient],
) -> None:
    """A request that opened a second session while its own held a connection would, at
    pool-size concurrency, wait on itself (200 readers at once stalled for minutes)."""
    api, raw = gateway
    run = await api.create_run(_config(_env(A)), start=False)
    app = raw._transport.app  # type: ignore[attr-defined]
    pool = app.state.sessionmaker.kw["bind"].sync_engine.pool
    held, most = 0, 0

    def checkout(*_: object) -> None:
        nonlocal held, most
        held += 1
        most = max(most, held)

    def checkin(*_: object) -> None:
        nonlocal held
        held -= 1

    event.listen(pool, "checkout", checkout)
    event.listen(pool, "checkin", checkin)
    try:
        for method, path, body in (
            ("GET", f"/v1/runs/{run.id}", None),
            ("GET", f"/v1/runs/{run.id}/metrics", None),
            ("PATCH", f"/v1/runs/{run.id}", {"set": [{"id": B}]}),
            ("GET", f"/ui/api/runs/{run.id}", None),
        ):
            most = 0
            answer = await raw.request(method, path, json=body)
            assert answer.status_code == 200, answer.text
            assert most == 1, f"{method} {path} held {most} connections at once"
    finally:
        event.remove(pool, "checkout", checkout)
        event.remove(pool, "checkin", checkin)
