"""`agentflow trainer` without `--run`: the run is found by the config's name on a real
`agentflow serve`, or created there (`trainer.remote.find_or_create_run`).

A trainer restarted by its supervisor must take up the run its first start created, not
create a second; a run that ended is not taken up; and a create whose answer was lost is
not sent again blind. No training step runs here: the lookup is what is tested, plus the
CLI's wiring up to the point where it would train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.client import RetryPolicy
from agentflow.errors import AgentFlowError
from agentflow.run_config import RunConfig
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from trainer.remote import find_or_create_run

pytestmark = pytest.mark.integration

# Short waits: the faults below are injected, not a gateway that needs time to come back.
FAST = RetryPolicy(window_s=10, first_wait_s=0.05, max_wait_s=0.2)


@pytest.fixture(scope="module")
def gateway(sqlite_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real gateway with the scripted parity env registered; its URL and the env's name."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path_factory.mktemp("gateway"), port):
        env = {
            "name": "lookup-parity",
            "kind": "python",
            "spec": {"entry_point": "tests.integration.rollout.scripted_envs:ParityEnv"},
        }
        made = httpx.post(f"{url}/v1/envs", json=env)
        assert made.status_code in (201, 409), made.text  # 409: an earlier module made it
        yield url


def _config(name: str, **rollout: Any) -> dict[str, Any]:
    return {
        "name": name,
        "seed": 3,
        "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}},
        "engine": {"type": "local", "max_batch_size": 8},
        "envs": [{"id": "lookup-parity", "max_concurrency": 4}],
        "agent": {"max_turns": 1, "max_new_tokens": 4},
        "rollout": {"group_size": 2, "max_staleness": 0, "max_concurrency": 4, **rollout},
        "trainer": {"batch_episodes": 2, "steps": 1},
        "weights": {"sync": "disk"},
    }


def _unique(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"  # the database is shared by the session


def _runs(url: str, name: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/runs", params={"name": name, "limit": 100}).json()["items"]


def _stop(url: str, run_id: object) -> None:
    stopped = httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped", stopped.text


async def test_a_restart_resumes_the_run_and_an_ended_run_is_not_resumed(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup")))

    first, created = await find_or_create_run(config, gateway, retry=FAST)
    assert created and first.name == config.name and first.status == "running"
    # What the gateway stored is this config (the full dump the client posts).
    assert RunConfig.model_validate(first.config) == config

    again, created = await find_or_create_run(config, gateway, retry=FAST)
    assert not created and again.id == first.id  # a restarted trainer takes it up

    _stop(gateway, first.id)
    fresh, created = await find_or_create_run(config, gateway, retry=FAST)
    assert created and fresh.id != first.id and fresh.status == "running"
    assert {r["id"]: r["status"] for r in _runs(gateway, config.name)} == {
        str(fresh.id): "running",
        str(first.id): "stopped",
    }
    _stop(gateway, fresh.id)


async def test_a_run_that_never_starts_is_waited_on_then_passed_over(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup-pending")))
    # Stored but never started (nothing starts a run left pending): the lookup waits for
    # it to start, then creates a new run rather than train one that plays nothing.
    body = _config(config.name)
    pending = httpx.post(f"{gateway}/v1/runs", params={"start": "false"}, json=body)
    assert pending.status_code == 201 and pending.json()["status"] == "pending", pending.text
    started = time.monotonic()
    made, created = await find_or_create_run(config, gateway, retry=FAST, pending_wait_s=1)
    assert created and str(made.id) != pending.json()["id"] and made.status == "running"
    assert time.monotonic() - started >= 1  # it did wait

    # Now the newest open run is again a pending one, newer than the running one: it is
    # passed over for the running one, not for a third run.
    again = httpx.post(f"{gateway}/v1/runs", params={"start": "false"}, json=body)
    assert again.status_code == 201, again.text
    found, created = await find_or_create_run(config, gateway, retry=FAST, pending_wait_s=0.2)
    assert not created and found.id == made.id
    assert len(_runs(gateway, config.name)) == 3
    _stop(gateway, made.id)


async def test_the_newest_open_run_is_taken_and_an_ended_one_skipped(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup-paused")))
    paused, _ = await find_or_create_run(config, gateway, retry=FAST)
    pause = httpx.post(f"{gateway}/v1/runs/{paused.id}/pause", timeout=30)
    assert pause.status_code == 200 and pause.json()["status"] == "paused", pause.text
    # A newer run of the name that ended is skipped however new it is.
    newer = httpx.post(f"{gateway}/v1/runs", json=_config(config.name), timeout=60)
    assert newer.status_code == 201, newer.text
    _stop(gateway, newer.json()["id"])
    found, created = await find_or_create_run(config, gateway, retry=FAST)
    assert not created and found.id == paused.id and found.status == "paused"
    # Of two open runs, the newer is taken.
    newest = httpx.post(f"{gateway}/v1/runs", json=_config(config.name), timeout=60)
    assert newest.status_code == 201, newest.text
    found, created = await find_or_create_run(config, gateway, retry=FAST)
    assert not created and str(found.id) == newest.json()["id"] and found.status == "running"
    _stop(gateway, paused.id)
    _stop(gateway, found.id)


class _Faults(httpx.AsyncBaseTransport):
    """The real connection to the gateway, with a fault on the first `POST /v1/runs`."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.creates = 0
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        creating = request.method == "POST" and request.url.path == "/v1/runs"
        self.creates += creating
        if not creating or self.creates > 1:
            return await self._inner.handle_async_request(request)
        if self.fault == "refused":  # a proxy's 503 before the gateway stored anything
            return httpx.Response(503, stream=httpx.ByteStream(b"upstream restarting"))
        response = await self._inner.handle_async_request(request)
        await response.aread()
        await response.aclose()
        assert response.status_code == 201
        if self.fault == "lost":  # stored, but the answer never arrives
            raise httpx.ReadError("connection reset while reading the answer")
        # "ended": stored, then stopped before this side heard of it, and a 502 arrives.
        run_id = json.loads(response.content)["id"]
        stop = httpx.Request("POST", request.url.join(f"/v1/runs/{run_id}/stop"))
        stopped = await self._inner.handle_async_request(stop)
        await stopped.aread()
        return httpx.Response(502, stream=httpx.ByteStream(b"bad gateway"))

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_create_whose_answer_was_lost_is_not_sent_again(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup-lost")))
    faults = _Faults("lost")
    run, created = await find_or_create_run(config, gateway, retry=FAST, transport=faults)
    assert created and faults.creates == 1  # the lookup found the stored run
    assert [r["id"] for r in _runs(gateway, config.name)] == [str(run.id)]
    _stop(gateway, run.id)


async def test_a_create_that_stored_nothing_is_sent_again(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup-refused")))
    faults = _Faults("refused")
    run, created = await find_or_create_run(config, gateway, retry=FAST, transport=faults)
    assert created and faults.creates == 2 and run.status == "running"
    assert [r["id"] for r in _runs(gateway, config.name)] == [str(run.id)]
    _stop(gateway, run.id)


async def test_a_lost_create_whose_run_ended_is_an_error_not_a_second_run(gateway: str) -> None:
    config = RunConfig.model_validate(_config(_unique("lookup-ended")))
    faults = _Faults("ended")
    with pytest.raises(AgentFlowError, match=r"was created but is stopped$"):
        await find_or_create_run(config, gateway, retry=FAST, transport=faults)
    assert faults.creates == 1
    assert [r["status"] for r in _runs(gateway, config.name)] == ["stopped"]


def test_the_trainer_command_without_run_names_the_run_it_takes_up(
    gateway: str, tmp_path: Path
) -> None:
    # A run of this name is live with group size 2; the trainer's config says 4, so it
    # stops after the lookup, before any training, naming the run it found.
    name = _unique("lookup-cli")
    live = httpx.post(f"{gateway}/v1/runs", json=_config(name), timeout=60).json()
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(_config(name, group_size=4)))
    trainer = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "trainer", str(config_file), "--gateway", gateway],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trainer.returncode == 1, trainer.stdout + trainer.stderr
    assert f"trainer: run {live['id']} resumed (running), named '{name}'" in trainer.stderr
    assert "rollout.group_size" in trainer.stderr and "stop it" in trainer.stderr
    assert [r["id"] for r in _runs(gateway, name)] == [live["id"]]  # nothing created
    _stop(gateway, live["id"])
