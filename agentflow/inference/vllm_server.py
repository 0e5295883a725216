"""A vLLM server this process starts from a run's checkpoint, and stops.

`VLLMServer(launch, model_path, port).start()` runs vLLM's OpenAI server module with the
python of vLLM's own venv (vLLM pins its own torch and transformers), with the RL routes
(`VLLM_SERVER_DEV_MODE=1`) and the token route (`--enable-scale-out`) mounted, and
returns once `/health` answers.

A vLLM server is three processes (the API server, its engine core, a worker), and the
engine core outlives an API server that is killed. So the server runs under a shell that
leads their process group and kills the whole group when the API server exits, however it
exits, or when the shell gets SIGTERM: from `stop()`, or from the kernel when this
process dies (the shell's parent-death signal, armed from one long-lived thread because
Linux sends it when the *thread* that forked the child exits).

A server killed with SIGKILL cannot remove the shared memory its engine core and worker
talk through (/dev/shm, 160 to 240 MB a server on CPU), so `stop()` removes the segments
the server's processes had mapped, noted once it served: a run whose servers die and are
started again does not fill the machine's memory with what the dead ones left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentflow.errors import EngineUnavailable, InvalidInput
from agentflow.ports import free_port
from agentflow.run_config import VLLMLaunchConfig
from envs.desktop.processes import die_with

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Never shut down: a server's parent-death signal is bound to the thread that forked it.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-spawner")
# The group's leader: runs the server, and kills the group when the server exits or when
# it is told to stop (`kill 0`: every process of the caller's group, itself included).
GROUP_LEADER = (
    "/bin/sh",
    "-c",
    "trap 'kill -s KILL 0' TERM INT; \"$@\" & wait $!; kill -s KILL 0",
    "vllm-server",
)


def server_argv(
    launch: VLLMLaunchConfig, model_path: str, port: int, served_model_name: str | None
) -> list[str]:
    argv = [
        launch.python,
        "-m",
        SERVER_MODULE,
        "--model",
        model_path,
        "--host",
        launch.host,
        "--port",
        str(port),
        "--dtype",
        launch.dtype,
        "--enforce-eager",
        "--enable-scale-out",  # the token-in/token-out route
        "--enable-prompt-tokens-details",  # cached prompt tokens in each answer's usage
        "--enable-prefix-caching",
        # Log-probs of log_softmax(logits / temperature), as every engine here reports
        # them (vLLM's default is of the raw logits, whatever the temperature).
        "--logprobs-mode",
        "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if launch.max_model_len is not None:
        argv += ["--max-model-len", str(launch.max_model_len)]
    return argv + list(launch.extra_args)


def server_env(launch: VLLMLaunchConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # pause/resume, reload, weight versions, abort by id
        VLLM_CPU_KVCACHE_SPACE=str(launch.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # share the cores with the gateway
        OMP_NUM_THREADS=str(launch.threads),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",  # a local checkpoint; nothing is fetched
        # The CPU build's sampler is wrapped in torch.compile, whose inductor backend needs
        # a C++ compiler at the first request; without one the engine core dies there. The
        # model itself runs eager (--enforce-eager), so nothing here needs compiling.
        TORCHDYNAMO_DISABLE="1",
    )
    # The venv's python must not pick up this process's packages.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(launch.env)  # the run's own settings last: they are what it asked for
    return env


def check_python(launch: VLLMLaunchConfig) -> None:
    if not Path(launch.python).is_file():
        raise InvalidInput(
            f"no python at {launch.python!r}: make vLLM's venv with "
            '`agentflow engine install-vllm` (docs/inference.md, "vLLM")',
            field=("engine", "launch", "python"),
        )


class VLLMServer:
    """One server process; `url` once `start` returned."""

    def __init__(
        self,
        launch: VLLMLaunchConfig,
        model_path: str,
        *,
        port: int = 0,
        served_model_name: str | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.launch = launch
        self.model_path = model_path
        self.port = port
        self.served_model_name = served_model_name
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._tail: deque[str] = deque(maxlen=40)
        self._stopped = False  # stop() was called: a start still under way gives up
        self._segments: set[Path] = set()  # the server's shared memory, removed by stop()

    def start(self) -> str:
        check_python(self.launch)
        port = self.port or free_port(self.launch.host)
        argv = server_argv(self.launch, self.model_path, port, self.served_model_name)
        log.info("starting a vLLM server: %s", " ".join(argv))
        self.url = f"http://{self.launch.host}:{port}"
        log_path = self._log_path(port)
        parent = os.getpid()

        def spawn() -> subprocess.Popen[bytes]:
            out = log_path.open("ab")
            try:
                return subprocess.Popen(
                    [*GROUP_LEADER, *argv],
                    env=server_env(self.launch),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=die_with(parent, signal.SIGTERM),
                    start_new_session=True,
                )
            finally:
                out.close()

        self.process = _SPAWNER.submit(spawn).result()
        self.log_path = log_path
        self._wait_healthy(self.launch.ready_s)
        self._segments = shared_memory_of(self.process.pid)
        if self._stopped:  # stopped while it started (its pool closed): nothing serves
            self.stop()
            raise EngineUnavailable(f"the vLLM server at {self.url} was stopped as it started")
        return self.url

    def _log_path(self, port: int) -> Path:
        directory = self.log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"vllm-{port}.log"

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stopped:
            code = self.process.poll()
            if code is not None:
                raise EngineUnavailable(
                    f"the vLLM server for {self.model_path} exited with {code} before "
                    f"serving; the end of its log ({self.log_path}):\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(0.5)
        if self._stopped:
            return  # start() says so
        self.stop()
        raise EngineUnavailable(
            f"the vLLM server at {self.url} did not answer /health in {timeout_s:.0f} s; "
            f"the end of its log ({self.log_path}):\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def server_pid(self) -> int | None:
        """The API server's own pid (the group leader's child), while it runs."""
        if self.process is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            path = f"/proc/{self.process.pid}/task/{self.process.pid}/children"
            children = Path(path).read_text().split()
            return int(children[0]) if children else None
        return None

    def stop(self) -> None:
        """End every process of the server: the group is killed even when its leader is
        already gone (what is left of a server that died). Called while `start` runs in
        another thread, it makes that start give up and end what it started."""
        self._stopped = True
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)
        for segment in self._segments:
            segment.unlink(missing_ok=True)
        self._segments = set()


def shared_memory_of(group: int) -> set[Path]:
    """The /dev/shm files the processes of process group `group` have mapped."""
    segments: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.getpgid(int(proc.name)) != group:
                continue
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                    segments.add(Path(path))
    return segments
