"""Runs on vLLM servers: white-box episodes recorded with the server's tokens and
log-probs, servers that are not the run's refused at the start, a black-box agent's chat
with a tool call through the gateway, and two servers behind one pool (sessions keep
their server; one killed with `kill -9` loses nothing and comes back on the newest
weights)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.errors import EngineLost, InvalidInput
from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef, WeightUpdate
from agentflow.inference.factory import build_engine
from agentflow.inference.pool import EnginePool
from agentflow.inference.vllm import VLLMEngine
from agentflow.inference.vllm_server import VLLMServer
from agentflow.modeling import load_model, score
from agentflow.run_config import RunConfig
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.agents.blackbox.conftest import Gateway
from tests.integration.inference.vllm.conftest import Served, client_of, launch_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def run_config(served: Served, **engine: Any) -> dict[str, Any]:
    return {
        "name": f"vllm-{uuid.uuid4().hex[:6]}",
        "model": {"path": str(served.checkpoints.policy)},
        "engine": {"type": "vllm", "urls": [served.url], **engine},
        "weights": {"sync": "disk"},
        "envs": [{"id": "agentflow/guess-number-v0"}],
        "agent": {"max_turns": 3, "max_new_tokens": 8, "temperature": 1.0},
        "rollout": {"group_size": 2, "max_episodes": 4, "wait_for_trainer": False},
    }


@pytest.fixture
async def api(sqlite_database: str) -> AsyncIterator[AsyncClient]:
    app = create_app(Settings(database_url=sqlite_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as client:
            yield client


async def test_whitebox_episodes_record_the_servers_tokens(
    vllm_server: Served, api: AsyncClient
) -> None:
    run = await api.create_run(run_config(vllm_server))
    deadline = asyncio.get_running_loop().time() + 120
    while (await api.get_run(run.id)).status != "finished":
        assert asyncio.get_running_loop().time() < deadline, "the run did not finish"
        await asyncio.sleep(0.2)
    episodes = (await api.list_run_episodes(run.id)).items
    assert len(episodes) == 4 and {e.status for e in episodes} <= {"completed", "truncated"}
    model = load_model(vllm_server.checkpoints.policy)
    checked = 0
    for episode in episodes:
        for listed in (await api.get_episode(episode.id))["trajectories"]:
            trajectory = await api.get_trajectory(listed["id"])
            ids, mask = trajectory["token_ids"], trajectory["loss_mask"]
            ours = score(model, ids, 1.0, start=1)
            sampled = [i for i in range(1, len(ids)) if mask[i]]
            assert sampled
            recorded = [trajectory["logprobs"][i] for i in sampled]
            assert [ours[i - 1] for i in sampled] == pytest.approx(recorded, abs=2e-3)
            checked += len(sampled)
    assert checked > 0


def test_servers_that_are_not_the_runs_are_refused(vllm_server: Served) -> None:
    other = run_config(vllm_server)
    other["model"] = {"path": str(vllm_server.checkpoints.other)}
    with pytest.raises(InvalidInput) as wrong:
        build_engine(RunConfig.model_validate(other))
    message = str(wrong.value)
    assert str(vllm_server.checkpoints.policy) in message
    assert str(vllm_server.checkpoints.other) in message
    assert vllm_server.url in message

    # A tied checkpoint is refused before any server is asked: vLLM would lose the tie.
    tied = run_config(vllm_server)
    tied["model"] = {"path": str(vllm_server.checkpoints.tied)}
    with pytest.raises(InvalidInput, match="untie-head"):
        build_engine(RunConfig.model_validate(tied))

    silent = run_config(vllm_server, urls=["http://127.0.0.1:9"])
    with pytest.raises(InvalidInput, match="127.0.0.1:9 does not answer"):
        build_engine(RunConfig.model_validate(silent))


def test_a_server_with_another_vocabulary_is_refused(vllm_server: Served) -> None:
    """The checkpoint check off, a run whose tokenizer is Qwen3's (the real one, from the
    package that ships it) meets the byte-level server: the probe text differs."""
    from agentflow.inference.vllm_pool import _check_server
    from tests.support.model_files import template_for

    config = RunConfig.model_validate(run_config(vllm_server, check_model=False))
    with pytest.raises(InvalidInput, match="another vocabulary") as refused:
        _check_server(vllm_server.url, config, template_for("qwen3"), "/models/qwen3")
    assert vllm_server.url in str(refused.value) and "/models/qwen3" in str(refused.value)
    # The run's own vocabulary passes, and the server's context is the run's.
    own = _check_server(
        vllm_server.url, config, ByteChatTemplate(), str(vllm_server.checkpoints.policy)
    )
    assert own == 1024


@pytest.fixture
def gateway(sqlite_database: str) -> Iterator[Gateway]:
    server = Gateway(sqlite_database)
    server.start()
    yield server
    server.stop()


async def test_a_blackbox_agent_calls_a_tool_through_the_gateway(
    vllm_server: Served, gateway: Gateway
) -> None:
    engine = client_of(vllm_server)
    runtime = PolicyRuntime(
        engine=engine,
        template=ByteChatTemplate(),
        model_name="tool-caller",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
        max_context=1024,
    )
    run = gateway.new_run(runtime)
    episode = gateway.new_episode(run)
    checkpoints = vllm_server.checkpoints
    messages, tools, key = checkpoints.messages, checkpoints.tools, checkpoints.lookup_key
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key(episode))
    async with client:
        answer = await client.chat.completions.create(model="m", messages=messages, tools=tools)
    gateway.call(engine.close())
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"key": key}
    turn = uuid.UUID(answer.id.removeprefix("chatcmpl-"))
    (policy,) = [t for t in gateway.call(gateway.turns.path(turn)) if t.kind == "policy"]
    assert policy.logprobs is not None and len(policy.logprobs) == len(policy.token_ids)


async def test_two_servers_behind_one_pool_and_one_killed(vllm_server: Served) -> None:
    """The shared server and one launched here, in one pool. Sessions spread over both
    and keep their server (the second turn finds its prefix cached); the launched one is
    killed with SIGKILL: its session fails with `EngineLost` (the agent resends the turn
    on a new session), the other goes on, and the pool starts it again, on the newest
    weights."""
    checkpoints = vllm_server.checkpoints
    launch = launch_config()

    def launched() -> VLLMServer:
        return VLLMServer(launch, str(checkpoints.policy))

    first = launched()
    await asyncio.to_thread(first.start)
    started = [first]

    shared = client_of(vllm_server)

    async def replace(index: int, generation: int) -> VLLMEngine:
        server = launched()
        started.append(server)
        await asyncio.to_thread(server.start)
        return VLLMEngine(shared.settings.model_copy(update={"url": server.url}), server=server)

    own = VLLMEngine(shared.settings.model_copy(update={"url": first.url}), server=first)
    pool = EnginePool([shared, own], replace=replace)
    prompt = checkpoints.prompt
    sampling = SamplingParams(max_new_tokens=8, seed=1)
    try:
        version = await shared.current_version() + 1
        await pool.update_weights(WeightUpdate(path=str(checkpoints.policy), version=version))
        sessions = [await pool.open_session() for _ in range(2)]
        firsts = [
            await pool.generate(
                GenerateRequest(
                    input_ids=prompt, sampling=sampling, session=SessionRef(session_id=s)
                )
            )
            for s in sessions
        ]
        seconds = [
            await pool.generate(
                GenerateRequest(
                    input_ids=(65,),
                    sampling=sampling,
                    session=SessionRef(session_id=s, parent_rid=r.rid),
                )
            )
            for s, r in zip(sessions, firsts, strict=True)
        ]
        assert all(r.cached_tokens > 0 for r in seconds)
        assert len(shared._sessions) == len(own._sessions) == 1  # one session each

        own_session = next(s for s in sessions if s in own._sessions)
        api_server = first.server_pid()
        assert api_server is not None
        os.kill(api_server, signal.SIGKILL)
        with pytest.raises(EngineLost):
            await pool.generate(
                GenerateRequest(
                    input_ids=prompt, sampling=sampling, session=SessionRef(session_id=own_session)
                )
            )
        other_session = next(s for s in sessions if s != own_session)
        going_on = await pool.generate(
            GenerateRequest(
                input_ids=prompt, sampling=sampling, session=SessionRef(session_id=other_session)
            )
        )
        assert going_on.output_ids

        deadline = asyncio.get_running_loop().time() + 180
        while None in pool.engines() or pool.counters.replaced < 1:
            assert asyncio.get_running_loop().time() < deadline, "no replacement started"
            await asyncio.sleep(0.5)
        # Nothing of the killed server is left: its engine core and worker went with it.
        assert first.process is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(first.process.pid, 0)
        back = pool.engines()[1]
        assert isinstance(back, VLLMEngine) and back.url != first.url
        assert await back.current_version() == version  # the pool's newest weights
    finally:
        await pool.close()
        for server in started:
            server.stop()
