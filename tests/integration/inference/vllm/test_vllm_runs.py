"""Runs on vLLM servers: white-box episodes recorded with the server's tokens and
log-probs, servers that are not the run's refused at the start, a black-box agent's chat
with a tool call through the gateway, and a run on two servers it launched, one killed
with `kill -9` mid-run (nothing lost or recorded twice; it comes back on the run's newest
weights; sessions keep their server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select

from agentflow.agents.runtime import PolicyRuntime
from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings
from agentflow.db.models import Episode, Turn
from agentflow.errors import InvalidInput
from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef
from agentflow.inference.factory import build_engine
from agentflow.inference.pool import EnginePool
from agentflow.inference.vllm import VLLMEngine
from agentflow.modeling import load_model, score
from agentflow.run_config import RunConfig
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.agents.blackbox.conftest import Gateway
from tests.integration.inference.vllm.conftest import (
    MAX_MODEL_LEN,
    PLUGINS,
    Checkpoints,
    Served,
    client_of,
    launch_config,
)

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


async def test_an_episode_past_the_servers_context_ends_truncated(
    vllm_server: Served, api: AsyncClient
) -> None:
    """The run's context is the server's `max_model_len` (1024 here), whatever token
    budget the agent asks for: an episode that would pass it ends truncated, with the
    reason, and the run goes on."""
    config = run_config(vllm_server)
    config["agent"] = {
        "max_turns": 200,
        "max_new_tokens": 64,
        "max_tokens": 8192,
        "temperature": 0.0,  # greedy: the same episodes every time
    }
    config["rollout"] = {"group_size": 2, "max_episodes": 2, "wait_for_trainer": False}
    # Guesses enough to fill the context (the env's own default ends at 5).
    config["envs"] = [{"id": "agentflow/guess-number-v0", "kwargs": {"max_turns": 200}}]
    run = await api.create_run(config)
    deadline = asyncio.get_running_loop().time() + 240
    while (await api.get_run(run.id)).status != "finished":
        assert asyncio.get_running_loop().time() < deadline, "the run did not finish"
        await asyncio.sleep(0.2)
    episodes = (await api.list_run_episodes(run.id)).items
    assert len(episodes) == 2
    for episode in episodes:
        assert (episode.status, episode.error) == ("truncated", "token budget reached")
        for listed in (await api.get_episode(episode.id))["trajectories"]:
            trajectory = await api.get_trajectory(listed["id"])
            # It got to the server's limit (no request past it: the server would have
            # refused it and failed the episode).
            assert len(trajectory["token_ids"]) > MAX_MODEL_LEN - 64


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
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"key": key}
    turn = uuid.UUID(answer.id.removeprefix("chatcmpl-"))
    (policy,) = [t for t in gateway.call(gateway.turns.path(turn)) if t.kind == "policy"]
    assert policy.logprobs is not None and len(policy.logprobs) == len(policy.token_ids)

    # Streamed, the same call arrives as chunks (vLLM's answer comes whole: the gateway
    # sends it as one stream of deltas) and is recorded the same way.
    streamed_episode = gateway.new_episode(run)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key(streamed_episode))
    async with client:
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=tools, stream=True
        )
        chunks = [chunk async for chunk in stream]
    gateway.call(engine.close())
    arguments = "".join(
        call.function.arguments or ""
        for chunk in chunks
        for call in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
        if call.function is not None
    )
    assert json.loads(arguments) == {"key": key}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    turn = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
    (policy,) = [t for t in gateway.call(gateway.turns.path(turn)) if t.kind == "policy"]
    assert policy.logprobs is not None and len(policy.logprobs) == len(policy.token_ids)


async def test_a_server_killed_mid_run_loses_nothing_and_comes_back(
    vllm_checkpoints: Checkpoints, sqlite_database: str, tmp_path: Path
) -> None:
    """A run that launches two servers itself (`[engine.launch] servers = 2`), one pool
    routed by session. Mid-run, with answers in flight on both, one server's API process
    is killed with SIGKILL: the turns it was answering are sent again on the other server
    (the agent reopens the session from the recorded context), no episode fails, no turn
    is recorded twice, the pool starts the server again on the run's newest version (the
    dead one's processes and shared memory gone), and a session on the pool keeps its
    server (its second turn is served from that server's prefix cache)."""
    pace_file = tmp_path / "pace"
    pace_file.write_text("0.2")  # s per decoding step: answers are in flight at the kill
    launch = launch_config(
        servers=2,
        extra_args=["--logits-processors", "agentflow_test_pacing:PacingLogitsProcessor"],
        env={"PYTHONPATH": str(PLUGINS), "AGENTFLOW_TEST_VLLM_PACE_FILE": str(pace_file)},
    )
    config = {
        "name": f"vllm-kill-{uuid.uuid4().hex[:6]}",
        "model": {"path": str(vllm_checkpoints.policy)},
        "engine": {"type": "vllm", "launch": launch.model_dump(mode="json")},
        "weights": {"sync": "disk"},
        "envs": [{"id": "agentflow/guess-number-v0"}],
        "agent": {"max_turns": 3, "max_new_tokens": 8, "temperature": 1.0},
        "rollout": {
            "group_size": 2,
            "max_concurrency": 8,
            "wait_for_trainer": False,
        },
        "trainer": {"run_dir": str(tmp_path / "runs")},
    }
    app = create_app(Settings(database_url=sqlite_database))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://gateway", transport=transport) as api:
            run = await api.create_run(config)  # returns once both servers answer
            pool = app.state.runtimes.get(run.id).engine
            assert isinstance(pool, EnginePool)
            first, second = pool.engines()
            assert isinstance(first, VLLMEngine) and isinstance(second, VLLMEngine)
            assert second.server is not None
            killed = second.server
            # A version published as the trainer publishes one: both servers load it.
            path = str(vllm_checkpoints.policy)
            assert await api.update_weights(run.id, 1, path=path) == 1

            # Answers in flight on both servers, some turns already recorded.
            await _until(lambda: all(s.in_flight > 0 for s in pool._slots), 120, "answers on both")
            api_server = killed.server_pid()
            assert api_server is not None
            segments = killed._segments  # its engine core's shared memory
            assert segments and all(p.exists() for p in segments)
            os.kill(api_server, signal.SIGKILL)

            # The pool starts it again, brought to the run's newest version.
            await _until(lambda: pool.counters.replaced >= 1, 300, "the server started again")
            back = pool.engines()[1]
            assert isinstance(back, VLLMEngine) and back.url != second.url
            assert await back.current_version() == 1
            assert killed.process is not None
            with pytest.raises(ProcessLookupError):  # its engine core and worker went too
                os.killpg(killed.process.pid, 0)
            assert not any(p.exists() for p in segments)  # and what they shared
            assert pool.counters.lost_requests >= 1  # it died answering

            # A session keeps its server: its second turn finds the first in that cache.
            session = await pool.open_session()
            sampling = SamplingParams(max_new_tokens=4, seed=1)
            turn = await pool.generate(
                GenerateRequest(
                    input_ids=vllm_checkpoints.prompt,
                    sampling=sampling,
                    session=SessionRef(session_id=session),
                )
            )
            again = await pool.generate(
                GenerateRequest(
                    input_ids=(65,),
                    sampling=sampling,
                    session=SessionRef(session_id=session, parent_rid=turn.rid),
                )
            )
            # (Whole KV blocks are cached: all of the prompt but its last partial block.)
            assert again.cached_tokens > len(vllm_checkpoints.prompt) // 2
            await pool.close_session(session)

            pace_file.unlink()
            # Episodes go on, on both servers, until the run is stopped.
            await _eventually(lambda: _ended(api, run.id, 12), 300, "12 episodes")
            await api.stop_run(run.id)
            await _eventually(lambda: _has_status(api, run.id, "stopped"), 120, "the run to stop")
            episodes = (await api.list_run_episodes(run.id, limit=500)).items
            assert {e.status for e in episodes} <= {"completed", "truncated", "aborted"}, [
                (e.status, e.error) for e in episodes if e.status == "failed"
            ]
            assert sum(e.status in ("completed", "truncated") for e in episodes) >= 12
            async with app.state.sessionmaker() as db:
                twice = (
                    await db.execute(
                        select(Turn.episode_id, Turn.depth)
                        .join(Episode, Episode.id == Turn.episode_id)
                        .where(Episode.run_id == run.id)
                        .group_by(Turn.episode_id, Turn.depth)
                        .having(func.count() > 1)
                    )
                ).all()
            assert twice == []  # one turn per depth: no turn recorded twice


async def _ended(api: AsyncClient, run_id: uuid.UUID, n: int) -> bool:
    episodes = (await api.list_run_episodes(run_id, limit=500)).items
    return sum(e.status in ("completed", "truncated") for e in episodes) >= n


async def _has_status(api: AsyncClient, run_id: uuid.UUID, status: str) -> bool:
    return (await api.get_run(run_id)).status == status


async def _eventually(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
