"""`GET /v1/blobs/{sha256}` and the images listed by the episode and trajectory routes,
on both databases with the store the settings choose (files beside SQLite, the table on
PostgreSQL)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from agentflow.api.app import create_app
from agentflow.config import Settings
from agentflow.db.blobs import DatabaseBlobStore, FileBlobStore
from agentflow.db.turn_tree import TurnTree
from agentflow.images import blob_id
from agentflow.types import TurnRecord

pytestmark = pytest.mark.integration

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[FastAPI]:
    app = create_app(Settings(database_url=database_url, api_key="s3cret"))
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def http(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def _episode_with_images(turns: TurnTree) -> dict[str, Any]:
    png = b"\x89PNG\r\n\x1a\n" + os.urandom(128)
    jpeg = b"\xff\xd8\xff\xe0" + os.urandom(128)
    episode = await turns.create_episode()
    prompt = await turns.add_turn(
        episode, None, TurnRecord(kind="prompt", token_ids=(1, 2), images=(png,))
    )
    policy = await turns.add_turn(
        episode,
        prompt,
        TurnRecord(kind="policy", token_ids=(3,), logprobs=(-0.5,), weight_versions=(0,)),
    )
    env = await turns.add_turn(
        episode, policy, TurnRecord(kind="env", token_ids=(4,), images=(jpeg, png))
    )
    (trajectory,) = await turns.complete_episode(episode, "completed", 1.0)
    return {"episode": episode, "trajectory": trajectory, "png": png, "jpeg": jpeg, "env": env}


async def test_blobs_are_served_and_listed(
    app: FastAPI, http: httpx.AsyncClient, database_url: str
) -> None:
    turns: TurnTree = app.state.turn_tree
    expected = FileBlobStore if database_url.startswith("sqlite") else DatabaseBlobStore
    assert isinstance(turns.blob_store, expected)
    made = await _episode_with_images(turns)
    png, jpeg = made["png"], made["jpeg"]

    for data, media_type in ((png, "image/png"), (jpeg, "image/jpeg")):
        response = await http.get(f"/v1/blobs/{blob_id(data)}", headers=KEY)
        assert response.status_code == 200
        assert response.content == data
        assert response.headers["content-type"] == media_type
        assert "immutable" in response.headers["cache-control"]

    episode = (await http.get(f"/v1/episodes/{made['episode']}", headers=KEY)).json()
    root = episode["roots"][0]
    env = root["children"][0]["children"][0]
    assert root["images"] == [blob_id(png)]
    assert root["image_urls"] == [f"/v1/blobs/{blob_id(png)}"]
    assert root["children"][0]["images"] == root["children"][0]["image_urls"] == []
    assert env["images"] == [blob_id(jpeg), blob_id(png)]
    for url in env["image_urls"]:
        assert (await http.get(url, headers=KEY)).status_code == 200

    trajectory = (await http.get(f"/v1/trajectories/{made['trajectory']}", headers=KEY)).json()
    assert trajectory["turn_images"] == [
        [{"sha256": blob_id(png), "url": f"/v1/blobs/{blob_id(png)}"}],
        [],
        [
            {"sha256": blob_id(jpeg), "url": f"/v1/blobs/{blob_id(jpeg)}"},
            {"sha256": blob_id(png), "url": f"/v1/blobs/{blob_id(png)}"},
        ],
    ]


async def test_unknown_malformed_and_unauthenticated(http: httpx.AsyncClient) -> None:
    unknown = await http.get(f"/v1/blobs/{blob_id(b'nothing')}", headers=KEY)
    assert unknown.status_code == 404
    for bad in ("abc", "A" * 64, "g" * 64, "0" * 65):
        response = await http.get(f"/v1/blobs/{bad}", headers=KEY)
        assert response.status_code == 422
        (detail,) = response.json()["detail"]
        assert detail["loc"] == ["path", "sha256"] and "SHA-256" in detail["msg"]
    assert (await http.get(f"/v1/blobs/{'0' * 64}")).status_code == 401
    assert (await http.get("/v1/blobs/nope")).status_code == 401  # the key before the id
