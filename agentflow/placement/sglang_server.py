"""An SGLang server started by its engine actor, on the actor's node and GPUs.

The actor runs `placement.sglang_command` (SGLang's `launch_server` by default) with the
placeholders filled in, waits until the server answers `/health`, and then serves the
gateway's calls through an `SGLangEngine` on that server. The server lives and dies with
its actor: it gets SIGKILL when the actor's process ends (however it ends), and the actor
ends itself when the server exits, so a crashed server surfaces at the gateway as a lost
engine and is replaced like any other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from agentflow.errors import EngineUnavailable
from agentflow.ports import free_port
from agentflow.run_config import RunConfig
from envs.desktop.processes import die_with

log = logging.getLogger(__name__)


def server_argv(config: RunConfig, host: str, port: int) -> list[str]:
    """`placement.sglang_command` with its placeholders filled in."""
    placement = config.placement
    values = {
        "python": sys.executable,
        "model_path": config.model.path or "",
        "host": host,
        "port": str(port),
        "tp": str(max(1, int(placement.engine_gpus))),
    }
    return [part.format(**values) for part in placement.sglang_command]


class SGLangServer:
    """One server process; `url` once `start` returned."""

    def __init__(self, config: RunConfig, host: str) -> None:
        self.config = config
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> str:
        port = free_port(self.host)
        argv = server_argv(self.config, self.host, port)
        log.info("starting an SGLang server: %s", " ".join(argv))
        # Killed with this process, however it ends: a killed actor never leaves a server
        # holding its GPUs.
        self.process = subprocess.Popen(
            argv, preexec_fn=die_with(os.getpid()), start_new_session=True
        )
        self.url = f"http://{self.host}:{port}"
        self._wait_healthy(self.config.placement.sglang_ready_s)
        return self.url

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise EngineUnavailable(f"the SGLang server exited with {code} before serving")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise EngineUnavailable(f"the SGLang server did not answer /health in {timeout_s:.0f} s")

    def exit_with_server(self) -> None:
        """End this process when the server exits (a thread waits for it)."""
        process = self.process
        assert process is not None

        def watch() -> None:
            code = process.wait()
            if not self._stopping:
                log.error("the SGLang server exited with %s; its engine actor ends too", code)
                os._exit(1)

        self._stopping = False
        threading.Thread(target=watch, name="sglang-server-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
