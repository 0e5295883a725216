"""A run whose agent is an `http` agent service, started through the REST API of a real
gateway process: the gateway briefs the service, the service drives the model with the
official openai client, and the episodes complete with the env's reward."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.tokenization.bytes import ByteTokenizer
from tests.integration.agents.blackbox.test_agent_kinds import (  # noqa: F401 (fixture)
    agent_service,
    service_agent,
)
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration


def test_http_agent_run_through_the_api(
    sqlite_database: str,
    tmp_path: Path,
    agent_service: Callable[[Any], str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A port of its own and no AGENTFLOW_PUBLIC_URL: agents are handed the address served.
    monkeypatch.delenv("AGENTFLOW_PUBLIC_URL", raising=False)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port):
        service = agent_service(service_agent)
        created = httpx.post(
            f"{url}/v1/runs",
            timeout=120,
            json={
                "name": "http-agents",
                "model": {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 1024}},
                "envs": [{"id": "agentflow/lookup-v0"}],
                "agent": {"type": "http", "url": service, "deadline_s": 60, "max_new_tokens": 8},
                "rollout": {"group_size": 2, "max_episodes": 2},
            },
        )
        assert created.status_code == 201, created.text
        episodes = _finished_episodes(url, created.json()["id"])
        assert [(e["status"], e["reward"]) for e in episodes] == [("completed", 1.0)] * 2
        tree = httpx.get(f"{url}/v1/episodes/{episodes[0]['id']}").json()
        assert tree["trajectories"] and tree["roots"][0]["kind"] == "prompt"


def test_a_reward_function_rescores_black_box_episodes(
    sqlite_database: str,
    tmp_path: Path,
    agent_service: Callable[[Any], str],  # noqa: F811
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    allow = {"AGENTFLOW_PUBLIC_URL": url, "AGENTFLOW_PLUGIN_MODULES": "tests.support"}
    with gateway_process(sqlite_database, tmp_path, port, **allow):
        created = httpx.post(
            f"{url}/v1/runs",
            timeout=120,
            json={
                "name": "http-agents-rescored",
                "model": {"init": {"layers": 2, "hidden": 64, "heads": 2, "max_context": 1024}},
                "envs": [
                    {"id": "agentflow/lookup-v0", "reward": "tests.support.plugins:text_length"}
                ],
                "agent": {
                    "type": "http",
                    "url": agent_service(service_agent),
                    "deadline_s": 60,
                    "max_new_tokens": 8,
                },
                "rollout": {"group_size": 2, "max_episodes": 2},
            },
        )
        assert created.status_code == 201, created.text
        episodes = _finished_episodes(url, created.json()["id"])
        assert [e["status"] for e in episodes] == ["completed"] * 2
        for episode in episodes:
            tree = httpx.get(f"{url}/v1/episodes/{episode['id']}").json()
            (node,) = tree["roots"]
            tokens = list(node["token_ids"])
            while node["children"]:  # the agent's calls chain: one leaf
                (node,) = node["children"]
                tokens += node["token_ids"]
            # The reward is the length of the episode's final text, decoded by the gateway.
            assert episode["reward"] == len(ByteTokenizer().decode(tokens)) > 100
            assert [t["reward"] for t in tree["trajectories"]] == [episode["reward"]]


def _finished_episodes(url: str, run_id: str) -> list[dict[str, Any]]:
    """The run's episodes once the run has finished."""
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/runs/{run_id}").json()["status"] != "finished":
        assert time.monotonic() < deadline, "run did not finish"
        time.sleep(0.2)
    items: list[dict[str, Any]] = httpx.get(f"{url}/v1/runs/{run_id}/episodes").json()["items"]
    return items
