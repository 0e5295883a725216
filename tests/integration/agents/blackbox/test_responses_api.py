"""`/v1/responses` driven by the official `openai` client and by the OpenAI Agents SDK
(its default API): answers recorded exactly as chat completions are, a multi-turn tool
loop on one path of the turn tree, and unsupported fields refused by name."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.agents.blackbox.conftest import TINY
from tests.integration.agents.blackbox.test_openai_client import client_for
from tests.support.teach import teach

pytestmark = pytest.mark.integration

INSTRUCTIONS = "Find the pet with the lookup tool, then answer."
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
}


def turn_of(response: Any) -> uuid.UUID:
    return uuid.UUID(response.model_extra["agentflow"]["turn_id"])


async def test_a_tool_loop_through_responses_is_one_path(
    gateway: Any, run_id: uuid.UUID, engine: Any
) -> None:
    episode = gateway.new_episode(run_id)
    items: list[dict[str, Any]] = [{"role": "user", "content": "What is ann's pet?"}]
    async with client_for(gateway, episode) as client:
        first = await client.responses.create(
            model="m",
            instructions=INSTRUCTIONS,
            input=items,
            tools=[TOOL],
            include=["message.output_text.logprobs"],
        )
        assert first.status in ("completed", "incomplete") and first.output_text is not None
        stored = gateway.call(gateway.turns.turn(turn_of(first)))
        text = first.output[0].content[0]
        assert stored.text == text.text
        assert [lp.logprob for lp in text.logprobs] == pytest.approx(list(stored.logprobs))
        assert first.usage.output_tokens == len(stored.token_ids)
        # The agent keeps the answer, is told to look it up, makes the call itself (the
        # tiny model cannot), and sends the result back.
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items += [
            {"role": "user", "content": "Use the tool."},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"k": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rex"},
        ]
        second = await client.responses.create(
            model="m", instructions=INSTRUCTIONS, input=items, tools=[TOOL]
        )
    path = gateway.call(gateway.turns.path(turn_of(second)))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]
    assert path[1].id == turn_of(first)
    context = gateway.call(gateway.turns.context(turn_of(second)))
    assert engine.seen(turn_of(second).hex) == list(context.token_ids)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"stream": True}, "stream"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ],
)
async def test_unsupported_responses_fields_are_refused_by_name(
    gateway: Any, run_id: uuid.UUID, extra: dict[str, Any], param: str
) -> None:
    episode = gateway.new_episode(run_id)
    body = {"model": "m", "input": "hi", **extra}
    async with client_for(gateway, episode) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(**body)
    assert (err.value.param or "").startswith(param)
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()


@pytest.fixture(scope="module")
def sdk_runs(gateway: Any, engine: Any, run_id: uuid.UUID) -> Iterator[tuple[uuid.UUID, Any]]:
    """The Agents SDK's first request, as the gateway renders it, and a run whose tiny
    model was taught to answer exactly that request with a `lookup` call."""
    episode = gateway.new_episode(run_id)
    # The random model answers with text, cut at the token limit (a response the SDK
    # ends with an error of its own); the request is what this run is for.
    run_agent(gateway, episode, max_turns=1)
    tree = gateway.call(gateway.turns.episode_tree(episode))
    policy = tree.roots[0].children[0]
    prompt = engine.contexts[policy.id.hex]
    template = ByteChatTemplate()
    call = json.dumps({"name": "lookup", "arguments": {"key": "ann.pet"}})
    target = [
        *template.tokenizer.encode(f"<|tool_call|>{call}<|/tool_call|>", allow_special=True),
        template.tokenizer.end_id,
    ]
    model = teach(TINY, prompt, target)
    local = LocalEngine(model, max_context=TINY.max_context)
    runtime = PolicyRuntime(
        engine=local,
        template=template,
        model_name="sdk-tool-caller",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
        max_context=TINY.max_context,
    )
    yield gateway.new_run(runtime), local
    gateway.call(local.close())


def run_agent(
    gateway: Any, episode: uuid.UUID, *, max_turns: int, calls: list[str] | None = None
) -> Any:
    """One `Runner.run` of an Agents SDK agent with a `lookup` tool; its final output, or
    the exception it ended with."""
    import asyncio

    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    seen = calls if calls is not None else []

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up."""
        seen.append(key)
        return "rex"

    async def play() -> Any:
        async with client_for(gateway, episode) as client:
            agent = Agent(
                name="finder",
                instructions=INSTRUCTIONS,
                tools=[lookup],
                model=OpenAIResponsesModel(model="any-model", openai_client=client),
            )
            try:
                run = await Runner.run(
                    agent,
                    "What is ann's pet?",
                    max_turns=max_turns,
                    run_config=RunConfig(tracing_disabled=True),
                )
            except Exception as exc:  # the SDK's own end, e.g. MaxTurnsExceeded
                return exc
            return run.final_output

    return asyncio.run(play())


def test_the_agents_sdk_runs_a_tool_loop_through_the_gateway(
    gateway: Any, sdk_runs: tuple[uuid.UUID, Any]
) -> None:
    run, _ = sdk_runs
    episode = gateway.new_episode(run)
    calls: list[str] = []
    run_agent(gateway, episode, max_turns=2, calls=calls)
    # The model's call reached the SDK, which ran the tool and sent its output back.
    assert calls and calls[0] == "ann.pet"
    tree = gateway.call(gateway.turns.episode_tree(episode))
    assert len(tree.roots) == 1  # one conversation
    first_answer = tree.roots[0].children[0]
    assert first_answer.kind == "policy" and len(first_answer.children) == 1
    tool_result = first_answer.children[0]
    assert tool_result.kind == "env" and tool_result.children[0].kind == "policy"
