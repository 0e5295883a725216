"""The cpu profile for real: images built offline, the stack up, an env registered through
the gateway's REST API, a short run trained by the split trainer, the gateway's process
killed with SIGKILL mid-run, and the stack down with nothing left.

The first build takes a few minutes (debootstrap, the wheelhouse, the images); the
engine caches them, so later runs rebuild only AgentFlow's own layer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentflow.stack import PROJECT_LABEL, Stack
from sandbox.docker_backend import LABEL as SANDBOX_LABEL
from tests.integration.test_serve import _free_port

# The first stack test's setup builds the images: 15 minutes or more on a loaded machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 20  # enough that the kill lands mid-run: a tiny model's steps take well under a second
RUN_NAME = "stack-test"
ENV_NAME = "stack-guess"


@pytest.fixture(scope="module")
def stack(stack_images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    ports = {name: _free_port() for name in ("GATEWAY", "SANDBOX", "POSTGRES")}
    run_config = tmp / "run.toml"
    run_config.write_text(_run_config())
    run_config.chmod(0o644)  # read by the trainer's unprivileged user
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
                f"AGENTFLOW_RUN_CONFIG={run_config}",
                "AGENTFLOW_TRAINER_THREADS=1",
            ]
        )
    )
    stack = Stack(ROOT, name=f"agentflow-test-{os.getpid()}", env_file=env_file)
    try:
        yield stack
    finally:
        stack.down()
        left = _docker_ids("volume", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={stack.name}")
        assert stack.containers() == [] and left == []
        # The sandbox service removed its pool's containers when it stopped. (Sandbox
        # tests on another worker share the engine: theirs come and go within seconds.)
        _wait(
            lambda: not _docker_ids("ps", "-a", "-q", "--filter", f"label={SANDBOX_LABEL}"),
            300,
            "no sandbox container left",
        )


def _docker_ids(*args: str) -> list[str]:
    listed = subprocess.run(["docker", *args], capture_output=True, text=True, check=True)
    return listed.stdout.split()


def _run_config() -> str:
    return f"""
name = "{RUN_NAME}"
seed = 3
[model]
init = {{ layers = 1, hidden = 32, heads = 2, max_context = 256 }}
[engine]
type = "local"
max_batch_size = 32
[[envs]]
id = "{ENV_NAME}"
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
"""


def _env_values(stack: Stack) -> dict[str, str]:
    assert stack.env_file is not None
    return dict(line.split("=", 1) for line in stack.env_file.read_text().splitlines())


def _sql(stack: Stack, query: str) -> list[list[str]]:
    """Rows of a query on the stack's own PostgreSQL, run inside its container."""
    cid = stack.container("postgres")
    assert cid is not None
    port = _env_values(stack)["AGENTFLOW_POSTGRES_PORT"]
    out = subprocess.run(
        ["docker", "exec", "-u", "postgres", cid, "psql", "-h", "/tmp", "-p", port,
         "-d", "agentflow", "-tA", "-F", "|", "-c", query],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [line.split("|") for line in out.splitlines() if line]


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_cpu_profile_trains_through_a_gateway_kill(stack: Stack, tmp_path: Path) -> None:
    env = _env_values(stack)
    gateway = f"http://127.0.0.1:{env['AGENTFLOW_GATEWAY_PORT']}"
    auth = {"Authorization": f"Bearer {env['AGENTFLOW_API_KEY']}"}
    stack.up("postgres", "gateway", "sandbox")

    # The sandbox service: its key is required, and it runs a command in a container of
    # its own (the runtime image), as the unprivileged sandbox user.
    sandbox = f"http://127.0.0.1:{env['AGENTFLOW_SANDBOX_PORT']}"
    body = {"cmd": "echo $((6 * 7)) > out; cat out; id -u"}
    assert httpx.post(f"{sandbox}/v1/exec", json=body, timeout=30).status_code == 401
    ran = httpx.post(
        f"{sandbox}/v1/exec",
        json=body,
        headers={"Authorization": f"Bearer {env['AGENTFLOW_SANDBOX_API_KEY']}"},
        timeout=30,
    )
    assert ran.status_code == 200, ran.text
    assert ran.json()["exit_code"] == 0 and ran.json()["stdout"] == "42\n65534\n"

    # An env registered through the REST API (the gateway refuses it without the key).
    spec = {
        "name": ENV_NAME,
        "kind": "python",
        "spec": {"entry_point": "envs.builtin.guess_number:GuessNumberEnv"},
    }
    assert httpx.post(f"{gateway}/v1/envs", json=spec, timeout=30).status_code == 401
    registered = httpx.post(f"{gateway}/v1/envs", json=spec, headers=auth, timeout=30)
    assert registered.status_code == 201, registered.text

    # The trainer finds no run of its config's name, creates it, and trains it.
    stack.up("trainer")

    def run() -> dict | None:
        page = httpx.get(f"{gateway}/v1/runs", params={"name": RUN_NAME}, headers=auth).json()
        return page["items"][0] if page["items"] else None

    first = _wait(lambda: (r := run()) and r["weight_version"] >= 1 and r, 300, "version 1")
    run_id = first["id"]

    # SIGKILL the gateway's server process (tini's child) mid-run.
    before = {
        row[0]
        for row in _sql(
            stack,
            f"SELECT t.id FROM turns t JOIN episodes e ON e.id = t.episode_id "
            f"WHERE e.run_id = '{run_id}'",
        )
    }
    assert before
    state = stack.state("gateway")
    restarts = int(state["restarts"])
    children = subprocess.run(
        ["pgrep", "-P", state["pid"]], capture_output=True, text=True, check=True
    ).stdout.split()
    (server,) = children
    # Read the version last, right before the kill: the run must still be training then.
    at_kill = httpx.get(f"{gateway}/v1/runs/{run_id}", headers=auth).json()["weight_version"]
    os.kill(int(server), signal.SIGKILL)

    # The restart policy brings it back; the run resumes from the database.
    _wait(lambda: int(stack.state("gateway")["restarts"]) > restarts, 120, "a restart")
    stack.wait_healthy(["gateway"], timeout=180)
    try:
        _wait(lambda: stack.state("trainer")["status"] == "exited", 600, "the trainer to finish")
    except AssertionError as exc:
        logs = stack.compose("logs", "--tail", "60", "trainer", "gateway").stdout
        raise AssertionError(f"{exc}; the trainer's and the gateway's logs:\n{logs}") from None
    trainer = stack.state("trainer")
    logs = stack.compose("logs", "--tail", "40", "trainer").stdout
    assert trainer["exit_code"] == "0", logs
    assert trainer["restarts"] == "0", logs  # it waited the gateway out, no restart needed

    final = httpx.get(f"{gateway}/v1/runs/{run_id}", headers=auth).json()
    assert final["weight_version"] == STEPS  # one version per step, across the kill
    # Versions after the kill went through the restarted gateway. (New episodes after the
    # restart are not guaranteed: the trajectories already stored may be enough to finish.)
    assert at_kill < STEPS
    (only,) = httpx.get(f"{gateway}/v1/runs", params={"name": RUN_NAME}, headers=auth).json()[
        "items"
    ]
    assert only["id"] == run_id  # the same run all along
    versions = _sql(stack, f"SELECT version FROM weight_versions WHERE run_id = '{run_id}'")
    assert sorted(int(v) for (v,) in versions)[-1] == STEPS

    # No turn written before the kill is lost.
    after = {
        row[0]
        for row in _sql(
            stack,
            f"SELECT t.id FROM turns t JOIN episodes e ON e.id = t.episode_id "
            f"WHERE e.run_id = '{run_id}'",
        )
    }
    assert before <= after
    statuses = dict(
        _sql(
            stack,
            f"SELECT status, count(*) FROM trajectories WHERE run_id = '{run_id}' GROUP BY status",
        )  # fmt: skip
    )
    assert "leased" not in statuses  # nothing left leased to the finished trainer
    # Every trained batch acknowledged: as many consumed as the steps trained. (A batch is
    # whole groups, and a group is short by the episodes the kill failed.)
    steps = _trainer_metrics(stack, tmp_path)
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    assert int(statuses["consumed"]) == sum(int(row["trajectories"]) for row in steps)


def _trainer_metrics(stack: Stack, tmp_path: Path) -> list[dict]:
    """The trainer's metrics.jsonl, copied out of its (exited) container's data volume."""
    cid = stack.container("trainer")
    assert cid is not None
    copied = tmp_path / "metrics.jsonl"
    subprocess.run(
        ["docker", "cp", f"{cid}:/data/runs/{RUN_NAME}/metrics.jsonl", str(copied)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [json.loads(line) for line in copied.read_text().splitlines() if line]
