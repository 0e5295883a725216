"""A black-box agent's episode survives the death of the engine holding its session:
the gateway opens the session again on a live engine of the pool and sends the whole
context (the official `openai` client sees no error)."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import SamplingParams
from agentflow.inference.pool import EnginePool
from agentflow.tokenization.chat import ByteChatTemplate
from tests.unit.inference.test_engine_pool import as_engines, member

pytestmark = pytest.mark.integration


async def test_a_call_after_its_engine_died_goes_on_on_another(gateway: Any) -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    runtime = PolicyRuntime(
        engine=pool,
        template=ByteChatTemplate(),
        sampling=SamplingParams(max_new_tokens=8),
        max_context=128,
    )
    run_id = gateway.new_run(runtime)
    episode = gateway.new_episode(run_id)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key(episode))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    async with client:
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "again"}]
        session = f"episode-{episode.hex}"
        holder = next(m for m in members if session in m.engine._sessions)
        holder.kill()
        second = await client.chat.completions.create(model="m", messages=messages)
        messages += [second.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "and again"}]
        third = await client.chat.completions.create(model="m", messages=messages)
    survivor = next(m for m in members if m is not holder)
    assert session in survivor.engine._sessions  # reopened there
    assert pool.counters.lost == 1 and pool.counters.lost_requests >= 1
    assert second.usage is not None and third.usage is not None
    assert third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens > 0  # the new session serves on
    turn = third.model_extra["agentflow"]["turn_id"]
    path = gateway.call(gateway.turns.path(uuid.UUID(turn)))
    assert [t.kind for t in path if t.kind == "policy"] == ["policy"] * 3
    gateway.call(pool.close())
