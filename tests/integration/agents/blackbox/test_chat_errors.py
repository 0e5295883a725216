"""Bad input on the chat and callback routes: clear 4xx in OpenAI's error shape, and
other episodes unaffected."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "hi"}]
BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


def post(gateway: Any, path: str, key: str | None, body: Any = None, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=60, **kw)


def assert_openai_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["message"]
    return dict(error)


def test_malformed_requests_are_400(gateway, run_id) -> None:
    episode = gateway.new_episode(run_id)
    key = gateway.key(episode)
    raw = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert_openai_error(raw, 400, "invalid_request_error")
    for body, param in [
        ({"model": "m"}, "messages"),
        ({**BODY, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({**BODY, "n": 3}, "n"),
        ({**BODY, "messages": [*MESSAGES, {"role": "assistant", "content": "pre"}]}, "messages"),
    ]:
        error = assert_openai_error(
            post(gateway, "/v1/chat/completions", key, body), 400, "invalid_request_error"
        )
        assert error["param"] == param
    # Text no database can hold, numbers JSON does not have: named, in OpenAI's shape.
    for raw_body, param in [
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000"}]}',
            "messages.0.content",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        (b'{"model": "m", "max_tokens": 2, "temperature": NaN, "messages": []}', None),
        (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}', None),
    ]:
        response = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            content=raw_body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        assert assert_openai_error(response, 400, "invalid_request_error")["param"] == param
    # A conversation longer than the model's context is refused before it reaches the engine.
    huge = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    error = assert_openai_error(
        post(gateway, "/v1/chat/completions", key, huge), 400, "invalid_request_error"
    )
    assert "context" in error["message"]
    # None of it was recorded, and the episode still works.
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()
    assert post(gateway, "/v1/chat/completions", key, BODY).status_code == 200


def test_keys_bind_to_one_episode(gateway, run_id) -> None:
    mine, other = gateway.new_episode(run_id), gateway.new_episode(run_id)
    path = f"/v1/episodes/{mine}/chat/completions"
    assert_openai_error(post(gateway, path, None, BODY), 401, "authentication_error")
    forged = gateway.key(mine)[:-4] + "0000"
    assert_openai_error(post(gateway, path, forged, BODY), 401, "authentication_error")
    assert_openai_error(post(gateway, path, gateway.key(other), BODY), 401, "authentication_error")
    assert post(gateway, path, gateway.key(mine), BODY).status_code == 200

    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-not-an-episode-key")
    with bad, pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    models = httpx.get(
        f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {gateway.key(mine)}"}
    )
    assert "tiny-policy" in [m["id"] for m in models.json()["data"]]
    assert httpx.get(f"{gateway.url}/v1/models").status_code == 401


def test_unknown_and_finished_episodes(gateway, run_id) -> None:
    ghost = uuid.uuid4()
    error = assert_openai_error(
        post(gateway, "/v1/chat/completions", gateway.key(ghost), BODY), 404, "not_found_error"
    )
    assert str(ghost) in error["message"]
    path = "/v1/episodes/not-a-uuid/chat/completions"  # not the episode the key is for
    assert_openai_error(post(gateway, path, gateway.key(ghost), BODY), 401, "authentication_error")

    done = gateway.new_episode(run_id)
    gateway.call(gateway.turns.complete_episode(done, "failed", error="test"))
    error = assert_openai_error(
        post(gateway, "/v1/chat/completions", gateway.key(done), BODY), 409, "invalid_request_error"
    )
    assert "failed" in error["message"]

    orphan_run = gateway.call(gateway._new_run())  # a run with no live engine
    orphan = gateway.new_episode(orphan_run)
    assert_openai_error(
        post(gateway, "/v1/chat/completions", gateway.key(orphan), BODY), 404, "not_found_error"
    )


def test_flooding_episode_gets_429_others_unaffected(gateway, run_id) -> None:
    flooded, calm = gateway.new_episode(run_id), gateway.new_episode(run_id)
    state = gateway.live.chat(flooded)
    state.in_flight = gateway.live.max_in_flight  # as if that many requests were running
    try:
        error = assert_openai_error(
            post(gateway, "/v1/chat/completions", gateway.key(flooded), BODY),
            429,
            "rate_limit_error",
        )
        assert "in flight" in error["message"]
        assert post(gateway, "/v1/chat/completions", gateway.key(calm), BODY).status_code == 200
    finally:
        state.in_flight = 0
    assert post(gateway, "/v1/chat/completions", gateway.key(flooded), BODY).status_code == 200


def test_callbacks_need_a_running_agent(gateway, run_id) -> None:
    episode = gateway.new_episode(run_id)
    key = gateway.key(episode)
    base = f"/v1/episodes/{episode}"
    assert post(gateway, f"{base}/reward", key, {"reward": 1.0}).status_code == 409
    assert post(gateway, f"{base}/complete", key, {"status": "completed"}).status_code == 409
    assert post(gateway, f"{base}/complete", key, {"status": "great"}).status_code == 422
    assert post(gateway, f"{base}/reward", None, {"reward": 1.0}).status_code == 401
    other = gateway.key(gateway.new_episode(run_id))
    assert post(gateway, f"{base}/reward", other, {"reward": 1.0}).status_code == 401
    ghost = uuid.uuid4()
    assert (
        post(
            gateway, f"/v1/episodes/{ghost}/reward", gateway.key(ghost), {"reward": 1.0}
        ).status_code
        == 404
    )
