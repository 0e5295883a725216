"""The official `openai` client, unchanged but for base_url and api_key, drives a
multi-turn tool-calling agent through a real gateway on loopback (tiny LocalEngine,
`agentflow/lookup-v0` giving the tool results)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import SamplingParams
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.types import StoredTurn
from envs.base import Observation, ToolCallsAction
from envs.builtin.lookup import LookupEnv, oracle
from tests.integration.agents.blackbox.conftest import TINY
from tests.support.teach import teach

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "Find the pet with the lookup tool, then answer."}


def client_for(gateway: Any, episode_id: uuid.UUID) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key(episode_id))


def dump(messages: list[Any]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


async def play(client: openai.AsyncOpenAI, env: LookupEnv, **create: Any) -> dict[str, Any]:
    """An agent loop: each turn asks the model and keeps its answer in the conversation;
    the tool calls are the agent's own (the tiny random model cannot make them), run on
    the env, and the final answer goes to the env's verifier."""
    first = await env.reset(seed=7)
    history: list[Observation] = [first.observation]
    messages: list[dict[str, Any]] = [SYSTEM, *dump(first.observation.messages)]
    answers = []
    for _ in range(6):
        answer = await client.chat.completions.create(
            model="whatever-the-agent-says", messages=messages, tools=env.tools(), **create
        )
        answers.append(answer)
        messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        action = oracle(history)
        result = await env.step(action)
        if not isinstance(action, ToolCallsAction):
            return {"messages": messages, "answers": answers, "reward": result.reward}
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in action.calls
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages += dump(result.observation.messages)
        history.append(result.observation)
    raise AssertionError("the oracle did not finish")


def turn_of(answer: Any) -> uuid.UUID:
    return uuid.UUID(answer.model_extra["agentflow"]["turn_id"])


async def test_multi_turn_agent_is_recorded_call_by_call(gateway, run_id, engine) -> None:
    episode = gateway.new_episode(run_id)
    async with client_for(gateway, episode) as client:
        played = await play(client, LookupEnv(hops=2), logprobs=True)
    assert played["reward"] == 1.0  # the env's verifier judged the agent's answer
    answers = played["answers"]
    assert len(answers) == 3

    tree = gateway.call(gateway.turns.episode_tree(episode))
    assert len(tree.roots) == 1  # one conversation, no branch
    path: list[StoredTurn] = gateway.call(gateway.turns.path(turn_of(answers[-1])))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy", "env", "policy"]
    assert [t.id for t in path if t.kind == "policy"] == [turn_of(a) for a in answers]

    for answer in answers:
        turn_id = turn_of(answer)
        stored = gateway.call(gateway.turns.turn(turn_id))
        choice = answer.choices[0]
        # The stored log-probs are the engine's, token for token, as the answer reported.
        assert len(stored.token_ids) == answer.usage.completion_tokens
        assert stored.logprobs == pytest.approx([t.logprob for t in choice.logprobs.content])
        assert stored.weight_versions == (0,) * len(stored.token_ids)
        assert stored.finish_reason in ("stop", "length")
        # The engine ran on exactly the stored context, and made exactly the stored tokens.
        context = gateway.call(gateway.turns.context(turn_id))
        assert engine.seen(turn_id.hex) == list(context.token_ids)
        assert answer.usage.prompt_tokens == len(context.token_ids) - len(stored.token_ids)
    # Later calls continue the engine session: only the new tokens are computed.
    assert answers[-1].usage.prompt_tokens_details.cached_tokens > 0


async def test_editing_an_earlier_message_branches(gateway, run_id) -> None:
    episode = gateway.new_episode(run_id)
    async with client_for(gateway, episode) as client:
        await _branches(gateway, episode, client)


async def _branches(gateway: Any, episode: uuid.UUID, client: openai.AsyncOpenAI) -> None:
    played = await play(client, LookupEnv(hops=2))
    leaf = turn_of(played["answers"][-1])
    before = gateway.call(gateway.turns.path(leaf))
    first_policy = before[1]

    # The agent rewrites the first tool result (index 4) and asks again.
    messages = played["messages"][:5]
    assert messages[4]["role"] == "tool"
    messages[4] = {**messages[4], "content": "someone-else"}
    tools = LookupEnv().tools()
    branched = await client.chat.completions.create(model="m", messages=messages, tools=tools)
    new_turn = gateway.call(gateway.turns.turn(turn_of(branched)))
    branch_point = gateway.call(gateway.turns.turn(new_turn.parent_id))
    assert branch_point.kind == "env" and branch_point.parent_id == first_policy.id
    assert len(gateway.call(gateway.turns.children(first_policy.id))) == 2

    # And one that edits the very first question starts a second root.
    edited = [SYSTEM, {"role": "user", "content": "What pet does ann's friend have?!"}]
    fresh = await client.chat.completions.create(model="m", messages=edited)
    fresh_path = gateway.call(gateway.turns.path(turn_of(fresh)))
    assert fresh_path[0].id != before[0].id and len(fresh_path) == 2

    after = gateway.call(gateway.turns.path(leaf))
    assert after == before  # the original path is untouched, token for token
    leaves = gateway.call(gateway.turns.leaves(episode))
    assert {t.id for t in leaves} == {leaf, turn_of(branched), turn_of(fresh)}


async def test_streaming_records_like_non_streaming(gateway, run_id, engine) -> None:
    episode = gateway.new_episode(run_id)
    async with client_for(gateway, episode) as client:
        await _streams(gateway, episode, client, engine)


async def _streams(
    gateway: Any, episode: uuid.UUID, client: openai.AsyncOpenAI, engine: Any
) -> None:
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "ann.pet?"}]
    stream = await client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    turn_id = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
    stored = gateway.call(gateway.turns.turn(turn_id))
    assert stored.kind == "policy" and stored.logprobs is not None
    assert usage is not None and usage.completion_tokens == len(stored.token_ids)
    assert finish == [stored.finish_reason]
    context = gateway.call(gateway.turns.context(turn_id))
    assert engine.seen(turn_id.hex) == list(context.token_ids)

    # The streamed answer, echoed back, continues the same path; non-streaming this time.
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "and?"}]
    plain = await client.chat.completions.create(model="m", messages=messages)
    path = gateway.call(gateway.turns.path(turn_of(plain)))
    assert [t.id for t in path][1] == turn_id
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]


async def test_recording_and_branching_on_postgresql(pg_stack) -> None:
    """The same agent through a gateway whose turn tree lives in PostgreSQL."""
    gateway = pg_stack.gateway
    episode = gateway.new_episode(pg_stack.run_id)
    async with client_for(gateway, episode) as client:
        played = await play(client, LookupEnv(hops=2), logprobs=True)
        answers = played["answers"]
        path = gateway.call(gateway.turns.path(turn_of(answers[-1])))
        assert [t.kind for t in path] == ["prompt", "policy", "env", "policy", "env", "policy"]
        for answer in answers:
            context = gateway.call(gateway.turns.context(turn_of(answer)))
            assert pg_stack.engine.seen(turn_of(answer).hex) == list(context.token_ids)
        messages = played["messages"][:5]
        messages[4] = {**messages[4], "content": "nobody"}
        branched = await client.chat.completions.create(
            model="m", messages=messages, tools=LookupEnv().tools()
        )
    branch = gateway.call(gateway.turns.path(turn_of(branched)))
    assert [t.id for t in branch[:2]] == [t.id for t in path[:2]]
    assert branch[2].id != path[2].id
    assert gateway.call(gateway.turns.path(turn_of(answers[-1]))) == path


@pytest.fixture(scope="module")
def tool_calling_run(gateway, engine) -> Iterator[tuple[uuid.UUID, str]]:
    """A run whose tiny model was taught (a few dozen steps of teacher forcing on one
    sequence) to answer this episode's first request with a real `lookup` call."""
    from agentflow.inference.local import LocalEngine

    env = LookupEnv(hops=2)
    first = asyncio.run(env.reset(seed=7))
    person = env.question.split("does ")[1].split("'s")[0]
    messages = [SYSTEM, *dump(first.observation.messages)]
    template = ByteChatTemplate()
    prompt = template.render(messages, tools=env.tools()).token_ids
    call = json.dumps({"name": "lookup", "arguments": {"key": f"{person}.friend"}})
    target = [
        *template.tokenizer.encode(f"<|tool_call|>{call}<|/tool_call|>", allow_special=True),
        template.tokenizer.end_id,
    ]
    model = teach(TINY, prompt, target, steps=200)
    local = LocalEngine(model, max_context=TINY.max_context)
    runtime = PolicyRuntime(
        engine=local,
        template=template,
        model_name="tool-caller",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
        max_context=TINY.max_context,
    )
    yield gateway.new_run(runtime), f"{person}.friend"
    gateway.call(local.close())


@pytest.mark.parametrize("stream", [False, True])
async def test_model_made_tool_calls_round_trip(gateway, tool_calling_run, stream) -> None:
    run, key = tool_calling_run
    episode = gateway.new_episode(run)
    env = LookupEnv(hops=2)
    first = await env.reset(seed=7)
    messages: list[dict[str, Any]] = [SYSTEM, *dump(first.observation.messages)]
    async with client_for(gateway, episode) as client:
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="m", messages=messages, tools=env.tools(), stream=True
                )
            ]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            head = next(d.tool_calls[0] for d in deltas if d.tool_calls)
            arguments = "".join(
                tc.function.arguments or "" for d in deltas for tc in d.tool_calls or ()
            )
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": head.id,
                        "type": "function",
                        "function": {"name": head.function.name, "arguments": arguments},
                    }
                ],
            }
            turn_id = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
        else:
            answer = await client.chat.completions.create(
                model="m", messages=messages, tools=env.tools()
            )
            finish = answer.choices[0].finish_reason
            message = answer.choices[0].message.model_dump(exclude_none=True)
            turn_id = turn_of(answer)
        assert finish == "tool_calls"
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "lookup"
        assert json.loads(call["function"]["arguments"]) == {"key": key}

        # The agent runs the model's call on the env and sends the result back.
        action = ToolCallsAction(
            calls=[
                {
                    "id": call["id"],
                    "name": "lookup",
                    "arguments": json.loads(call["function"]["arguments"]),
                }
            ]
        )
        result = await env.step(action)
        messages += [message, *dump(result.observation.messages)]
        assert messages[-1]["tool_call_id"] == call["id"]
        follow = await client.chat.completions.create(
            model="m", messages=messages, tools=env.tools()
        )
    path = gateway.call(gateway.turns.path(turn_of(follow)))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]
    assert path[1].id == turn_id and path[1].finish_reason == "stop"


def test_the_startup_check_finds_the_public_url_reaches_this_gateway(gateway) -> None:
    check = gateway.app.state.public_url_check
    deadline = time.monotonic() + 30
    while check.ok is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check.ok is True, check.detail
