"""`ContainerAgent`: an agent program run in a bubblewrap sandbox for one episode.

The program gets `OPENAI_BASE_URL` and `OPENAI_API_KEY` (so an unchanged OpenAI client
talks to the gateway), `AGENTFLOW_BRIEF` (a JSON file with the brief of
`outcome.start_episode`: task, first messages, tools, the callback and env-step URLs)
and `AGENTFLOW_GATEWAY_URL`. It ends either by `POST callback_url` or by exiting:
exit code 0 reports `completed` with its stdout (stripped) as the answer, anything else
`failed` with the exit code and the end of its stderr. Past `deadline_s` the sandbox
kills it and the episode fails with "agent did not finish within N s".

Network (`network=`):
- `"gateway"` (default): the sandbox has no network namespace of its own to share; it
  reaches the gateway, and only the gateway, through `relay.GatewayRelay`.
- `"host"`: `bwrap --share-net`. The program then shares the host's network namespace:
  it can reach every service listening on the host, loopback-only ones included (the
  database, other gateways, env servers), and any outside network the host can reach.
  Use it only for trusted programs that need more than the gateway.

What else the sandbox isolates is `sandbox.bwrap`'s docstring; the program and the
Python packages it imports must be visible in it (`ro_binds`, `files`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.blackbox.live import AgentReport, LiveEpisodes
from agentflow.agents.blackbox.outcome import REWARD_SOURCES, RewardSource, settle, start_episode
from agentflow.agents.blackbox.relay import INNER_RELAY, GatewayRelay
from envs.base import EnvError
from sandbox.base import ExecResult, ExecStatus, SandboxLimits
from sandbox.bwrap import BwrapSandbox

NetworkMode = Literal["gateway", "host"]
SANDBOX_DIR = "/work"  # the sandbox's work dir, as the program sees it
_BRIEF = "agentflow-brief.json"
_RELAY = ".agentflow-relay.py"
_SOCKET = ".agentflow-gateway.sock"
_MAX_ANSWER = 100_000


class ContainerAgent:
    def __init__(
        self,
        command: Sequence[str],
        live: LiveEpisodes,
        *,
        files: Mapping[str, str | bytes] | None = None,
        environment: Mapping[str, str] | None = None,
        deadline_s: float = 600.0,
        reward: RewardSource = "env",
        network: NetworkMode = "gateway",
        limits: SandboxLimits | None = None,
        ro_binds: Sequence[str] = (),
        python: str = "/usr/bin/python3",
        exit_grace_s: float = 5.0,
        sandbox_factory: Callable[..., BwrapSandbox] = BwrapSandbox,
    ) -> None:
        if not command:
            raise ValueError("command must name the agent program")
        if not 0 < deadline_s <= 3600:
            raise ValueError("deadline_s must be in (0, 3600] (the sandbox's wall-time bound)")
        if reward not in REWARD_SOURCES:
            raise ValueError(f"reward must be one of {REWARD_SOURCES}, got {reward!r}")
        if network not in ("gateway", "host"):
            raise ValueError(f"network must be 'gateway' or 'host', got {network!r}")
        self.command = list(command)
        self.live = live
        self.files = dict(files or {})
        self.environment = dict(environment or {})
        self.deadline_s = deadline_s
        self.reward: RewardSource = reward
        self.network: NetworkMode = network
        base = limits or SandboxLimits()
        self.limits = base.model_copy(
            update={"wall_time_s": deadline_s, "cpu_time_s": max(base.cpu_time_s, deadline_s)}
        )
        self.ro_binds = tuple(ro_binds)
        self.python = python
        self.exit_grace_s = exit_grace_s
        self._sandbox_factory = sandbox_factory

    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome:
        deadline = time.monotonic() + self.deadline_s
        try:
            slot, brief = await start_episode(self.live, episode)
        except EnvError as exc:
            return EpisodeOutcome(status="failed", error=f"env reset failed: {exc.message}")
        sandbox = self._sandbox_factory(
            limits=self.limits, network=self.network == "host", extra_ro_binds=self.ro_binds
        )
        relay: GatewayRelay | None = None
        try:
            command, gateway_url = list(self.command), episode.gateway_url.rstrip("/")
            if self.network == "gateway":
                relay = GatewayRelay(os.path.join(sandbox.workdir, _SOCKET), gateway_url)
                await relay.start()
                await sandbox.write_file(_RELAY, INNER_RELAY)
                port = str(urlsplit(gateway_url).port or 80)
                command = [
                    self.python,
                    f"{SANDBOX_DIR}/{_RELAY}",
                    port,
                    f"{SANDBOX_DIR}/{_SOCKET}",
                    *command,
                ]
                gateway_url = f"http://127.0.0.1:{port}"
                brief = _rebase(brief, episode.gateway_url.rstrip("/"), gateway_url)
            for path, data in self.files.items():
                await sandbox.write_file(path, data)
            await sandbox.write_file(_BRIEF, json.dumps(brief))
            env = {
                **self.environment,
                "OPENAI_BASE_URL": f"{gateway_url}/v1",
                "OPENAI_API_KEY": episode.api_key,
                "AGENTFLOW_GATEWAY_URL": gateway_url,
                "AGENTFLOW_EPISODE_ID": str(episode.episode_id),
                "AGENTFLOW_BRIEF": f"{SANDBOX_DIR}/{_BRIEF}",
            }
            program = asyncio.create_task(sandbox.exec(command, env=env))
            reported: asyncio.Future[AgentReport] = asyncio.ensure_future(
                asyncio.shield(slot.report)
            )
            waiting: set[asyncio.Future[Any]] = {program, reported}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            report: AgentReport | None
            if reported.done():
                report = reported.result()
                # The program has reported: let it exit on its own, briefly, then kill it.
                await asyncio.wait({program}, timeout=self.exit_grace_s)
                program.cancel()  # cancelling the exec kills the sandboxed tree
                await asyncio.wait({program})
                if not program.cancelled():
                    program.exception()  # retrieved: a sandbox failure here changes nothing
            else:
                reported.cancel()
                report = self._exit_report(program.result())
            if report is None:
                return EpisodeOutcome(
                    status="failed", error=f"agent did not finish within {self.deadline_s:g} s"
                )
            return await settle(slot, report, self.reward, deadline)
        finally:
            if relay is not None:
                await relay.close()
            await sandbox.close()
            await self.live.finish_agent(episode.episode_id)

    def _exit_report(self, result: ExecResult) -> AgentReport | None:
        if result.status is ExecStatus.TIME_LIMIT:
            return None
        if result.status is ExecStatus.FINISHED and result.exit_code == 0:
            return AgentReport(status="completed", answer=result.stdout.strip()[-_MAX_ANSWER:])
        tail = result.stderr.strip()[-500:]
        return AgentReport(
            status="failed",
            error=f"agent program ended ({result.status.value}, exit code "
            f"{result.exit_code}): {tail}",
        )


def _rebase(brief: dict[str, object], old: str, new: str) -> dict[str, object]:
    """The brief with the gateway's URLs as the program reaches them."""
    return {
        key: value.replace(old, new, 1)
        if isinstance(value, str) and value.startswith(old)
        else value
        for key, value in brief.items()
    }
