"""Fakes at the env boundaries: a subprocess "sandbox" and small misbehaving envs."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.base import Action, Message, Observation, StepResult, TextAction
from envs.turn_env import Outcome, TurnEnv
from sandbox import ExecResult, ExecStatus


class SubprocessSandbox:
    """Runs commands as host subprocesses: no isolation, only for unit tests of envs."""

    def __init__(self) -> None:
        self.commands: list[Sequence[str] | str] = []
        self.closed = 0

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        self.commands.append(cmd)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if argv[0] == "python3":
            argv[0] = sys.executable  # a direct interpreter: PATH may hold slow shims
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            out, err = await asyncio.wait_for(proc.communicate(data), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return ExecResult(
                stdout="",
                stderr="",
                exit_code=None,
                status=ExecStatus.TIME_LIMIT,
                duration_s=time.monotonic() - start,
            )
        return ExecResult(
            stdout=out.decode(),
            stderr=err.decode(),
            exit_code=proc.returncode,
            status=ExecStatus.FINISHED,
            duration_s=time.monotonic() - start,
        )

    async def write_file(self, path: str, data: str | bytes) -> None:
        raise NotImplementedError("not used by the envs under test")

    async def read_file(self, path: str) -> bytes:
        raise NotImplementedError("not used by the envs under test")

    async def close(self) -> None:
        self.closed += 1


class CountingEnv(TurnEnv):
    """Counts to ``goal``: text ``"+"`` adds one; reaching the goal ends with reward 1."""

    env_id = "test/counting-v0"

    def __init__(self, goal: int = 3) -> None:
        super().__init__(max_turns=goal + 2)
        self.goal, self.count = goal, 0
        self.closed_calls = 0

    async def _start(self, options: dict[str, Any]) -> Observation:
        self.count = 0
        return Observation(messages=[Message(role="user", content=f"count to {self.goal}")])

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        if action.text.strip() == "+":
            self.count += 1
        done = self.count >= self.goal
        text = str(self.count)
        return Outcome(
            Observation(messages=[Message(role="user", content=text)]),
            reward=1.0 if done else 0.0,
            terminated=done,
        )

    async def _release(self) -> None:
        self.closed_calls += 1


class RaisingEnv(CountingEnv):
    """Raises a bug-like error on the second step."""

    async def _turn(self, action: Action) -> Outcome:
        if self.turns >= 2:
            raise RuntimeError("simulated env bug")
        return await super()._turn(action)


class HangingEnv(CountingEnv):
    """Ignores the step timeout it is given and hangs (an env that misbehaves)."""

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class ThreadCheckingEnv(CountingEnv):
    """Fails if called from a thread other than the one that built it (thread-bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    async def _turn(self, action: Action) -> Outcome:
        if threading.get_ident() != self.thread:
            raise RuntimeError("called from a foreign thread")
        return await super()._turn(action)


class FakeContainer:
    """A container as the docker SDK returns it; publishes ``host_port``."""

    def __init__(self, host_port: int) -> None:
        self.attrs: dict[str, Any] = {}
        self.host_port = host_port
        self.calls: list[str] = []

    def reload(self) -> None:
        self.calls.append("reload")
        self.attrs = {
            "NetworkSettings": {"Ports": {"8000/tcp": [{"HostPort": str(self.host_port)}]}}
        }

    def remove(self, force: bool = False) -> None:
        self.calls.append(f"remove(force={force})")


class RecordingDockerClient:
    """Records ``containers.run`` calls, as ``docker.DockerClient`` would receive them."""

    def __init__(self, host_port: int) -> None:
        self.runs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.started: list[FakeContainer] = []
        self.host_port = host_port
        self.containers = self

    def run(self, *args: Any, **kwargs: Any) -> FakeContainer:
        self.runs.append((args, kwargs))
        container = FakeContainer(self.host_port)
        self.started.append(container)
        return container
