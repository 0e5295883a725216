"""Disk weight sync to engines in other processes: a mock SGLang worker and a gateway run.

One `WeightPublisher` writes version 1 once and switches two targets concurrently:

- an `SGLangEngine` → `/update_weights_from_disk` on a mock SGLang worker subprocess
  (a LocalEngine behind SGLang's HTTP API);
- a `GatewayWeightTarget` → `POST /v1/runs/{id}/weights` on `agentflow serve`, which
  plays a white-box run on its own local engine.

Each must then really serve the published weights, not just report a new number: the
worker's greedy `/generate` log-probs of a fixed prompt, and the log-probs the gateway
stored for the policy tokens of an episode played after the switch (exactly what its
engine sampled with, at the run's temperature 1), must equal the new model's
teacher-forced log-probs computed here with `agentflow.modeling.score`. The episodes
played before the switch pass the same check against the initial weights and fail it
against the new ones, so the check tells versions apart. The two servers boot in
parallel: their start-up (imports, model build) is most of the test's time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.inference.base import GenerateRequest, SamplingParams
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.modeling import ModelInit, build_model, score
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from trainer.weights import GatewayWeightTarget, WeightPublisher

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
INIT = {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}
PROMPT = (1, 72, 101, 108, 108, 111, 44, 32)


def model(seed: int) -> Any:
    return build_model(ModelInit.model_validate(INIT), seed=seed)


@pytest.fixture
def mock_worker() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A mock SGLang worker process, started but not yet waited for."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.support.mock_sglang",
            "--port", str(port), "--model-init", json.dumps(INIT), "--seed", "0",
        ],
        cwd=ROOT,  # where `tests` is importable
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


def _policy_turns(tree: dict[str, Any]) -> list[tuple[list[int], dict[str, Any]]]:
    """Each policy turn with the context it was generated after (root → its parent)."""
    found: list[tuple[list[int], dict[str, Any]]] = []
    stack: list[tuple[list[int], dict[str, Any]]] = [([], root) for root in tree["roots"]]
    while stack:
        context, node = stack.pop()
        if node["kind"] == "policy":
            found.append((context, node))
        stack.extend((context + list(node["token_ids"]), c) for c in node["children"])
    return found


def _latest_on(url: str, run_id: str, version: int) -> list[dict[str, Any]]:
    """The newest completed episodes whose policy tokens all come from `version`."""
    listed = f"{url}/v1/runs/{run_id}/episodes"
    params: dict[str, Any] = {"status": "completed", "limit": 1}
    total = httpx.get(listed, params=params).json()["total"]
    params |= {"limit": 5, "offset": max(0, total - 5)}  # oldest first: the last page
    found = []
    for episode in httpx.get(listed, params=params).json()["items"]:
        tree = httpx.get(f"{url}/v1/episodes/{episode['id']}").json()
        versions = {v for _, turn in _policy_turns(tree) for v in turn["weight_versions"]}
        if versions == {version}:
            found.append(tree)
    return found


def _wait_for(url: str, run_id: str, version: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while not (found := _latest_on(url, run_id, version)):
        assert time.monotonic() < deadline, f"no completed episode on version {version}"
        time.sleep(0.2)
    return found


def _assert_scored_by(trees: list[dict[str, Any]], weights: Any) -> None:
    for tree in trees:
        for context, turn in _policy_turns(tree):
            expected = score(weights, context + list(turn["token_ids"]), start=len(context))
            assert turn["logprobs"] == pytest.approx(expected, abs=1e-4)


def _start_run(url: str) -> str:
    env = {
        "name": f"weights-{time.monotonic_ns()}",
        "kind": "python",
        "spec": {
            "entry_point": "tests.integration.rollout.scripted_envs:SlowEnv",
            "kwargs": {"delay": 0.2, "steps": 2},
        },
    }
    assert httpx.post(f"{url}/v1/envs", json=env).status_code == 201
    config = {
        "name": "weight-sync",
        "seed": 0,
        "model": {"init": INIT},
        "envs": [{"id": env["name"]}],
        "agent": {"max_turns": 2, "max_new_tokens": 6, "temperature": 1.0},
        "rollout": {"group_size": 1, "min_concurrency": 1, "max_concurrency": 2},
    }
    created = httpx.post(f"{url}/v1/runs", json=config, timeout=60)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _assert_route_checks_its_body(url: str, run_id: str, directory: Path) -> None:
    weights = f"{url}/v1/runs/{run_id}/weights"
    for body, loc in [
        ({"version": 0, "path": str(directory)}, ["body", "version"]),
        ({"version": 1, "path": str(directory / "missing")}, ["body", "path"]),
        ({"version": 1, "path": str(directory), "force": True}, ["body", "force"]),
    ]:
        answer = httpx.post(weights, json=body)
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == loc
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
    broadcast = {"group_name": "g", "buckets": [bucket]}
    for body in ({"version": 1}, {"version": 1, "path": str(directory), "broadcast": broadcast}):
        answer = httpx.post(weights, json=body)
        assert answer.status_code == 422 and "exactly one of path or broadcast" in answer.text
    # A local engine takes no broadcast: the group routes say so.
    refused = httpx.get(f"{weights}/group")
    assert refused.status_code == 409 and "publish with disk sync" in refused.text
    group = {"master_address": "127.0.0.1", "master_port": 1, "group_name": "g", "world_size": 2}
    assert httpx.post(f"{weights}/group", json=group).status_code == 409
    assert httpx.post(f"{weights}/group", json={**group, "world_size": 1}).status_code == 422
    unknown = f"{url}/v1/runs/00000000-0000-0000-0000-000000000000/weights"
    assert httpx.post(unknown, json={"version": 1, "path": str(directory)}).status_code == 404


async def test_disk_sync_reaches_a_sglang_worker_and_a_gateway_run(
    mock_worker: tuple[str, subprocess.Popen[bytes]], sqlite_database: str, tmp_path: Path
) -> None:
    worker_url, worker = mock_worker
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # Build the new weights while both servers boot (importing transformers is slow).
    pool = ThreadPoolExecutor(max_workers=1)
    building = pool.submit(model, 7)
    pool.shutdown(wait=False)  # the build still runs to its end
    with gateway_process(sqlite_database, tmp_path, port):
        run_id = _start_run(url)
        _assert_route_checks_its_body(url, run_id, tmp_path)
        before = _wait_for(url, run_id, 0)
        _wait_healthy(worker_url, worker)

        trained = building.result()
        sglang = SGLangEngine(SGLangSettings(url=worker_url))
        gateway = GatewayWeightTarget(url, run_id)
        try:
            publisher = WeightPublisher(
                "disk", [sglang, gateway], tmp_path / "weights", config=trained.config
            )
            report = await publisher.publish(trained.state_dict(), version=1)
            assert [t.version for t in report.targets] == [1, 1]
            assert (await sglang.info()).weight_version == 1
            greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
            result = await sglang.generate(GenerateRequest(input_ids=PROMPT, sampling=greedy))
        finally:
            await sglang.close()
            await gateway.aclose()
        assert httpx.get(f"{url}/v1/runs/{run_id}").json()["weight_version"] == 1
        after = _wait_for(url, run_id, 1)
        httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=30)

    # The SGLang worker: every token from version 1, log-probs of the new model.
    assert result.token_versions() == [1] * len(result.output_ids)
    tokens = [*PROMPT, *result.output_ids]
    expected = score(trained, tokens, temperature=0.0, start=len(PROMPT))
    assert result.logprobs == pytest.approx(expected, abs=1e-4)
    initial = model(seed=0)
    assert result.logprobs != pytest.approx(
        score(initial, tokens, temperature=0.0, start=len(PROMPT)), abs=1e-3
    )
    # The gateway run: what it recorded after the switch was sampled from the new model.
    _assert_scored_by(after, trained)
    _assert_scored_by(before, initial)
    with pytest.raises(AssertionError):
        _assert_scored_by(before, trained)
