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
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port, AGENTFLOW_PUBLIC_URL=url):
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
        run_id = created.json()["id"]
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/v1/runs/{run_id}").json()["status"] != "finished":
            assert time.monotonic() < deadline, "run did not finish"
            time.sleep(0.2)
        episodes = httpx.get(f"{url}/v1/runs/{run_id}/episodes").json()["items"]
        assert [(e["status"], e["reward"]) for e in episodes] == [("completed", 1.0)] * 2
        tree = httpx.get(f"{url}/v1/episodes/{episodes[0]['id']}").json()
        assert tree["trajectories"] and tree["roots"][0]["kind"] == "prompt"
