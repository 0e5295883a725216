"""The vllm profile for real: images built offline (the vLLM image from a host-made
wheelhouse of its CPU build), the warm start written once by `model`, the `vllm` service
serving it, and the split trainer training a short run whose every version the gateway
has that server reload; the server's own weight version is the trainer's at the end.

The first build of the vLLM image takes a few minutes (a wheelhouse of about 1 GB); the
engine caches it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentflow.stack import PROJECT_LABEL, Stack
from tests.integration.test_serve import _free_port

# The first stack test's setup builds the images: 15 minutes or more on a loaded machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4
RUN_NAME = "stack-vllm-test"


def _run_config(vllm_port: int) -> str:
    return f"""
name = "{RUN_NAME}"
seed = 5
[model]
path = "/data/models/policy"
init = {{ layers = 1, hidden = 64, heads = 2, max_context = 256 }}
[engine]
type = "vllm"
urls = ["http://127.0.0.1:{vllm_port}"]
[[envs]]
id = "agentflow/guess-number-v0"
max_concurrency = 32
[agent]
max_turns = 3
max_new_tokens = 6
[rollout]
group_size = 4
max_staleness = 1
[trainer]
batch_episodes = 8
steps = {STEPS}
checkpoint_every = 2
threads = 1
run_dir = "/data/runs"
[weights]
sync = "disk"
dir = "/data/weights"
[warm_start]
n_episodes = 200
epochs = 1
eval_episodes = 10
"""


@pytest.fixture(scope="module")
def stack(stack_images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-stack")
    ports = {name: _free_port() for name in ("GATEWAY", "POSTGRES", "VLLM")}
    run_config = tmp / "run.toml"
    run_config.write_text(_run_config(ports["VLLM"]))
    run_config.chmod(0o644)  # read by the containers' unprivileged user
    env_file = tmp / "stack.env"
    env_file.write_text(
        "\n".join(
            [
                f"AGENTFLOW_API_KEY=gw-{uuid.uuid4().hex}",
                f"AGENTFLOW_SECRET_KEY=secret-{uuid.uuid4().hex}",
                f"AGENTFLOW_POSTGRES_PASSWORD=pg-{uuid.uuid4().hex}",
                f"AGENTFLOW_SANDBOX_API_KEY=sb-{uuid.uuid4().hex}",
                f"AGENTFLOW_DESKTOP_API_KEY=dk-{uuid.uuid4().hex}",
                *(f"AGENTFLOW_{name}_PORT={port}" for name, port in ports.items()),
                f"AGENTFLOW_VLLM_RUN_CONFIG={run_config}",
                "AGENTFLOW_TRAINER_THREADS=1",
            ]
        )
    )
    stack = Stack(
        ROOT, name=f"agentflow-vllm-test-{os.getpid()}", env_file=env_file, profiles=("vllm",)
    )
    try:
        yield stack
    finally:
        stack.down()
        left = subprocess.run(
            ["docker", "volume", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={stack.name}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert stack.containers() == [] and left == []


def _env(stack: Stack) -> dict[str, str]:
    assert stack.env_file is not None
    return dict(line.split("=", 1) for line in stack.env_file.read_text().splitlines())


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_vllm_profile_trains_through_the_vllm_service(stack: Stack, tmp_path: Path) -> None:
    env = _env(stack)
    gateway = f"http://127.0.0.1:{env['AGENTFLOW_GATEWAY_PORT']}"
    vllm = f"http://127.0.0.1:{env['AGENTFLOW_VLLM_PORT']}"
    auth = {"Authorization": f"Bearer {env['AGENTFLOW_API_KEY']}"}

    stack.up("postgres", "gateway", "model", "vllm", timeout=900)
    assert stack.state("model")["exit_code"] == "0"  # the warm start wrote the checkpoint
    served = httpx.get(f"{vllm}/v1/models", timeout=30).json()["data"][0]
    assert served["root"] == "/data/models/policy"

    stack.up("trainer-vllm", timeout=300)
    try:
        _wait(
            lambda: stack.state("trainer-vllm")["status"] == "exited", 600, "the trainer to finish"
        )
    except AssertionError:
        # What the run and the services said, so a failure here names its cause.
        logs = stack.compose("logs", "trainer-vllm", "gateway", "vllm").stdout
        runs = httpx.get(f"{gateway}/v1/runs", params={"name": RUN_NAME}, headers=auth).json()
        print(json.dumps(runs, indent=1)[:4000])
        said = [ln for ln in logs.splitlines() if "/health" not in ln and "/lease" not in ln]
        print("\n".join(said))
        raise
    trainer = stack.state("trainer-vllm")
    assert trainer["exit_code"] == "0", stack.compose("logs", "--tail", "40", "trainer-vllm").stdout

    (run,) = httpx.get(f"{gateway}/v1/runs", params={"name": RUN_NAME}, headers=auth).json()[
        "items"
    ]
    assert run["weight_version"] == STEPS
    # The server itself serves the trainer's last version: every publish reached it.
    assert httpx.get(f"{vllm}/weight_info", timeout=30).json()["weight_version"] == str(STEPS)
    steps = _trainer_metrics(stack, tmp_path)
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    # The episodes were played on the server: the turns carry its versions.
    episodes = httpx.get(
        f"{gateway}/v1/runs/{run['id']}/episodes", params={"limit": 5}, headers=auth
    ).json()["items"]
    assert episodes


def _trainer_metrics(stack: Stack, tmp_path: Path) -> list[dict]:
    cid = stack.container("trainer-vllm")
    assert cid is not None
    copied = tmp_path / "metrics.jsonl"
    subprocess.run(
        ["docker", "cp", f"{cid}:/data/runs/{RUN_NAME}/metrics.jsonl", str(copied)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [json.loads(line) for line in copied.read_text().splitlines() if line]
