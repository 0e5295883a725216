"""`http` and `container` agents complete episodes with rewards; one that never calls back
fails with its reason while another episode completes."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentflow.agents.base import Budget, EpisodeHandle
from agentflow.agents.blackbox import ContainerAgent, HttpAgent
from envs.base import Observation, ToolCallsAction
from envs.builtin.lookup import LookupEnv, oracle

pytestmark = pytest.mark.integration

SITE_PACKAGES = str(Path(openai.__file__).resolve().parents[1])


def service_agent(brief: dict[str, Any]) -> None:
    """A black-box agent as a service would run it: OpenAI client for the model, the
    gateway's env-step URL for the tools, and the completion callback at the end."""
    auth = {"Authorization": f"Bearer {brief['api_key']}"}
    history = [Observation.model_validate(brief["observation"])]
    messages = list(brief["messages"])
    with openai.OpenAI(base_url=brief["base_url"], api_key=brief["api_key"]) as client:
        for _ in range(6):
            answer = client.chat.completions.create(
                model=brief["model"], messages=messages, tools=brief["tools"]
            )
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
            action = oracle(history)
            if not isinstance(action, ToolCallsAction):
                report = {"status": "completed", "answer": action.text}
                httpx.post(brief["callback_url"], json=report, headers=auth).raise_for_status()
                return
            step = httpx.post(
                brief["env_step_url"], json={"action": action.model_dump()}, headers=auth
            )
            step.raise_for_status()
            observation = Observation.model_validate(step.json()["observation"])
            history.append(observation)
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in action.calls
            ]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            messages += [m.model_dump(exclude_none=True) for m in observation.messages]


@pytest.fixture
def agent_service() -> Iterator[Callable[[Callable[[dict[str, Any]], None] | None], str]]:
    """Start small agent services on loopback; each runs `behaviour` on the brief it gets
    (None: accept the episode and never call back)."""
    servers: list[ThreadingHTTPServer] = []
    workers: list[threading.Thread] = []

    def start(behaviour: Callable[[dict[str, Any]], None] | None) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                brief = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(202)
                self.end_headers()
                if behaviour is not None:
                    worker = threading.Thread(target=behaviour, args=(brief,))
                    workers.append(worker)
                    worker.start()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}/episodes"

    yield start
    for worker in workers:
        worker.join(timeout=60)
    for server in servers:
        server.shutdown()
        server.server_close()


def handle(gateway: Any, run_id: uuid.UUID, runtime: Any, seed: int) -> EpisodeHandle:
    episode = gateway.new_episode(run_id, {"seed": seed})
    return EpisodeHandle(
        episode_id=episode,
        run_id=run_id,
        env=LookupEnv(hops=2),
        runtime=runtime,
        turns=gateway.turns,
        task={"seed": seed},
        gateway_url=gateway.url,
        api_key=gateway.key(episode),
    )


def finish(gateway: Any, episode: EpisodeHandle, outcome: Any) -> list[Any]:
    """Complete the episode from the outcome, as the run executor does."""
    ids = gateway.call(
        gateway.turns.complete_episode(
            episode.episode_id, outcome.status, outcome.reward, error=outcome.error
        )
    )
    return gateway.call(gateway.turns.trajectories(ids))


def test_http_agent_completes_with_the_env_reward(gateway, run_id, runtime, agent_service):
    good = HttpAgent(agent_service(service_agent), gateway.live, deadline_s=60)
    silent = HttpAgent(agent_service(None), gateway.live, deadline_s=1)
    episode, stuck = handle(gateway, run_id, runtime, 1), handle(gateway, run_id, runtime, 2)

    async def both() -> tuple[Any, Any]:
        import asyncio

        return tuple(await asyncio.gather(good.run(episode), silent.run(stuck)))  # type: ignore[return-value]

    outcome, timed_out = gateway.call(both())
    assert timed_out.status == "failed"
    assert timed_out.error == "agent did not call back within 1 s"
    assert outcome.status == "completed" and outcome.reward == 1.0, outcome
    trajectories = finish(gateway, episode, outcome)
    assert [t.reward for t in trajectories] == [1.0]
    # Each of the agent's three model calls is a policy turn on that trajectory.
    kinds = [gateway.call(gateway.turns.turn(t)).kind for t in trajectories[0].turn_ids]
    assert kinds == ["prompt", "policy", "env", "policy", "env", "policy"]
    assert episode.episode_id not in gateway.live and stuck.episode_id not in gateway.live
    # After the episode ends its key opens nothing.
    late = httpx.post(
        f"{gateway.url}/v1/episodes/{stuck.episode_id}/complete",
        json={"status": "completed"},
        headers={"Authorization": f"Bearer {stuck.api_key}"},
    )
    assert late.status_code == 409


def test_http_agent_unreachable_service_fails_the_episode(gateway, run_id, runtime):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    agent = HttpAgent(f"http://127.0.0.1:{port}/x", gateway.live, deadline_s=5)
    outcome = gateway.call(agent.run(handle(gateway, run_id, runtime, 3)))
    assert outcome.status == "failed" and "unreachable" in (outcome.error or "")


CONTAINER_AGENT = r"""
import json, os, re, socket, sys, urllib.request
import openai

def reachable(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False

probe = int(os.environ["PROBE_PORT"])
if reachable(probe):  # a host service the sandbox must not see
    sys.exit(f"reached 127.0.0.1:{probe}")

brief = json.load(open(os.environ["AGENTFLOW_BRIEF"]))
auth = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json"}
def step(calls):
    body = json.dumps({"action": {"type": "tool_calls", "calls": calls}}).encode()
    req = urllib.request.Request(brief["env_step_url"], data=body, headers=auth)
    return json.load(urllib.request.urlopen(req))["observation"]["messages"][0]["content"]

client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
messages = list(brief["messages"])
person = re.search(r"What pet does (\w+)'s friend have", messages[0]["content"]).group(1)
for key in (person + ".friend", None):
    answer = client.chat.completions.create(model="m", messages=messages, tools=brief["tools"])
    messages.append(answer.choices[0].message.model_dump(exclude_none=True))
    if key is None:
        break
    call = {"id": "c1", "name": "lookup", "arguments": {"key": key}}
    friend = step([call])
    pet = step([{**call, "id": "c2", "arguments": {"key": friend + ".pet"}}])
    arguments = json.dumps(call["arguments"])
    messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": "c1",
        "type": "function", "function": {"name": "lookup", "arguments": arguments}}]})
    messages.append({"role": "tool", "tool_call_id": "c1", "content": friend})
print("answer: " + pet)
"""


def test_container_agent_completes_with_the_env_reward(gateway, run_id, runtime):
    with socket.socket() as probe:  # a host loopback service, as the database would be
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        agent = ContainerAgent(
            ["/usr/bin/python3", "/work/agent.py"],
            gateway.live,
            files={"agent.py": CONTAINER_AGENT},
            environment={"PYTHONPATH": SITE_PACKAGES, "PROBE_PORT": str(probe.getsockname()[1])},
            ro_binds=[SITE_PACKAGES],
            deadline_s=120,
        )
        episode = handle(gateway, run_id, runtime, 4)
        outcome = gateway.call(agent.run(episode), timeout=180)
    assert outcome.status == "completed" and outcome.reward == 1.0, outcome
    trajectories = finish(gateway, episode, outcome)
    assert [t.reward for t in trajectories] == [1.0]
    path = [gateway.call(gateway.turns.turn(t)).kind for t in trajectories[0].turn_ids]
    assert path == ["prompt", "policy", "env", "policy"]


def test_container_agent_that_crashes_fails_with_its_error(gateway, run_id, runtime):
    agent = ContainerAgent(
        ["/usr/bin/python3", "-c", "import sys; sys.exit('no luck')"], gateway.live, deadline_s=30
    )
    outcome = gateway.call(agent.run(handle(gateway, run_id, runtime, 5)))
    assert outcome.status == "failed" and "no luck" in (outcome.error or "")


@pytest.mark.parametrize(("network", "reached"), [("gateway", False), ("host", True)])
def test_container_network_reaches_only_the_gateway(gateway, run_id, runtime, network, reached):
    probe_program = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        port = str(probe.getsockname()[1])
        agent = ContainerAgent(
            ["/usr/bin/python3", "-c", probe_program, port],
            gateway.live,
            network=network,
            deadline_s=30,
        )
        outcome = gateway.call(agent.run(handle(gateway, run_id, runtime, 6)))
    # Exit 0 (the host port answered) completes the episode; exit 1 fails it.
    assert (outcome.status != "failed") is reached, outcome


def test_http_agent_with_an_external_reward(gateway, run_id, runtime, agent_service):
    def grader_agent(brief: dict[str, Any]) -> None:
        auth = {"Authorization": f"Bearer {brief['api_key']}"}
        with openai.OpenAI(base_url=brief["base_url"], api_key=brief["api_key"]) as client:
            client.chat.completions.create(model="m", messages=brief["messages"])
        # Someone outside (here the service itself) grades, then the agent says it is done.
        httpx.post(brief["reward_url"], json={"reward": 0.25}, headers=auth).raise_for_status()
        report = {"status": "completed"}
        httpx.post(brief["callback_url"], json=report, headers=auth).raise_for_status()

    agent = HttpAgent(agent_service(grader_agent), gateway.live, deadline_s=60, reward="external")
    episode = handle(gateway, run_id, runtime, 8)
    outcome = gateway.call(agent.run(episode))
    assert (outcome.status, outcome.reward) == ("completed", 0.25)
    assert [t.reward for t in finish(gateway, episode, outcome)] == [0.25]


def test_budget_refuses_more_turns_and_truncates(gateway, run_id, runtime, agent_service):
    seen: list[str] = []

    def chatty_agent(brief: dict[str, Any]) -> None:
        auth = {"Authorization": f"Bearer {brief['api_key']}"}
        messages = list(brief["messages"])
        with openai.OpenAI(
            base_url=brief["base_url"], api_key=brief["api_key"], max_retries=0
        ) as client:
            try:
                for _ in range(5):
                    answer = client.chat.completions.create(model="m", messages=messages)
                    messages.append(answer.choices[0].message.model_dump(exclude_none=True))
                    messages.append({"role": "user", "content": "go on"})
            except openai.ConflictError as exc:
                seen.append(str(exc.code))
        httpx.post(brief["callback_url"], json={"status": "completed"}, headers=auth)

    agent = HttpAgent(agent_service(chatty_agent), gateway.live, deadline_s=60)
    episode = handle(gateway, run_id, runtime, 9)
    episode.budget = Budget(max_turns=2, max_tokens=4096)
    outcome = gateway.call(agent.run(episode))
    assert outcome.status == "truncated" and outcome.error == "turn budget (2) reached"
    assert seen == ["budget_exhausted"]
    leaves = gateway.call(gateway.turns.leaves(episode.episode_id))
    assert len(leaves) == 1  # the refused request recorded nothing
    path = gateway.call(gateway.turns.path(leaves[0].id))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]


def test_agent_reports_are_refused_or_stored_exactly(gateway, run_id, runtime, agent_service):
    storable = ("\x01\x1b[31m\x7f tab\there é 😀 " * 400)[:10_000]
    answers: list[int] = []

    def reporter(brief: dict[str, Any]) -> None:
        auth = {"Authorization": f"Bearer {brief['api_key']}"}
        for error in ("a\x00b", "lone \ud800", storable):
            body = json.dumps({"status": "failed", "error": error}).encode()
            sent = httpx.post(
                brief["callback_url"],
                content=body,
                headers={**auth, "Content-Type": "application/json"},
            )
            answers.append(sent.status_code)

    agent = HttpAgent(agent_service(reporter), gateway.live, deadline_s=30)
    episode = handle(gateway, run_id, runtime, 4)
    outcome = gateway.call(agent.run(episode))
    deadline = time.monotonic() + 30  # the last answer may reach the agent after the run
    while len(answers) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert answers == [422, 422, 202], answers
    assert outcome.status == "failed" and outcome.error == storable
    finish(gateway, episode, outcome)
    stored = gateway.call(gateway.turns.episode(episode.episode_id))
    assert stored.error == storable
