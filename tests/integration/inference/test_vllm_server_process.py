"""`VLLMServer`'s processes, with a stand-in for vLLM's python (an HTTP server that
answers /health and starts a child, as vLLM's API server starts its engine core): the
launcher waits for health, and the whole process group goes when the API server is
killed or the server is stopped, so no engine core is left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agentflow.errors import EngineUnavailable
from agentflow.inference.vllm_server import VLLMServer
from agentflow.run_config import VLLMLaunchConfig

pytestmark = pytest.mark.integration

STAND_IN = f"""#!{sys.executable}
import http.server, subprocess, sys
args = sys.argv
port = int(args[args.index("--port") + 1])
if "--fail" in args:
    print("cannot start: --fail", flush=True)
    sys.exit(3)
subprocess.Popen(["sleep", "300"])  # the engine core
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def _group_gone(server: VLLMServer, timeout: float = 10.0) -> bool:
    """Whether no process of the server's group is left (its leader reaped: a zombie
    still counts as a member)."""
    assert server.process is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.process.poll()
        try:
            os.killpg(server.process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_api_server_takes_its_group_with_it(stand_in: Path, tmp_path: Path) -> None:
    server = VLLMServer(VLLMLaunchConfig(python=str(stand_in)), "/models/m", log_dir=tmp_path)
    server.start()
    assert server.process is not None and server.alive()
    api = server.server_pid()
    assert api is not None and api != server.process.pid
    os.kill(api, signal.SIGKILL)
    assert _group_gone(server), "the engine core outlived its API server"
    assert not server.alive()
    server.stop()  # nothing left to stop: no error


def test_stop_ends_every_process(stand_in: Path, tmp_path: Path) -> None:
    server = VLLMServer(VLLMLaunchConfig(python=str(stand_in)), "/models/m", log_dir=tmp_path)
    server.start()
    assert server.process is not None
    server.stop()
    assert _group_gone(server)


def test_a_server_that_exits_at_start_is_reported_with_its_log(
    stand_in: Path, tmp_path: Path
) -> None:
    launch = VLLMLaunchConfig(python=str(stand_in), extra_args=["--fail"])
    server = VLLMServer(launch, "/models/m", log_dir=tmp_path)
    with pytest.raises(EngineUnavailable, match="exited with .* before serving") as failed:
        server.start()
    assert "cannot start: --fail" in str(failed.value)


def test_the_group_dies_with_the_process_that_started_it(stand_in: Path, tmp_path: Path) -> None:
    import subprocess

    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from agentflow.inference.vllm_server import VLLMServer\n"
            "from agentflow.run_config import VLLMLaunchConfig\n"
            f"s = VLLMServer(VLLMLaunchConfig(python={str(stand_in)!r}), '/m', "
            f"log_dir=__import__('pathlib').Path({str(tmp_path)!r}))\n"
            "s.start()\n"
            "print(s.process.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        pgid = int(starter.stdout.readline())
        starter.kill()  # SIGKILL: no clean-up of its own runs
        starter.wait()
        deadline = time.monotonic() + 10
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            # The group's leader is this test's grandchild: init reaps it.
            assert time.monotonic() < deadline, "the server outlived the process that started it"
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()
        if starter.stdout is not None:
            starter.stdout.close()
