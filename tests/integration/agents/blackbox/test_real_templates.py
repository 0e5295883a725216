"""Multi-turn tool conversations through the gateway with real model families'
tokenizers and chat templates: Qwen3 and Mistral-Nemo (neither template is append-only;
Mistral's runs on the Llama 3 vocabulary), Llama 3.1 and DeepSeek V3. The model's tool
call, written in its family's format, reaches the `openai` client as a call; the agent's
tool result continues the same path of the turn tree; and every token the engine saw is
the recorded context, token for token."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import SamplingParams
from agentflow.tokenization.chat import HFChatTemplate
from agentflow.tokenization.tool_calls import render_tool_call
from tests.integration.agents.blackbox.test_openai_client import client_for, turn_of
from tests.support.engine import MockEngine, replay
from tests.support.model_files import template_for

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]
QUESTION = [
    {"role": "system", "content": "Answer with the lookup tool."},
    {"role": "user", "content": "What is ann's pet?"},
]
CALL = {"name": "lookup", "arguments": {"key": "ann.pet"}}
FINAL = "Ann's pet is a cat named rex."


def scripted_replies(template: HFChatTemplate, family: str) -> list[list[int]]:
    """What a model of `family` writes: a tool call in its format, then an answer."""
    tok = template.tokenizer
    call = render_tool_call(CALL, template.tool_call_style)
    if family == "qwen3":  # Qwen3 thinks first; its template drops the thought later
        call = "<think>\nI should look it up.\n</think>\n\n" + call
    eot = template.stop_ids[-1] if family != "deepseek-v3" else tok.eos_id
    return [
        [*tok.encode(call, allow_special=True), eot],
        [*tok.encode(FINAL, allow_special=True), eot],
    ]


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "deepseek-v3", "mistral-nemo"])
async def test_a_tool_conversation_records_exactly_what_the_engine_saw(
    gateway: Any, family: str
) -> None:
    template = template_for(family)
    engine = MockEngine(
        replay(scripted_replies(template, family)), vocab_size=len(template.tokenizer.hf)
    )
    runtime = PolicyRuntime(
        engine=engine,
        template=template,
        model_name=f"{family}-scripted",
        sampling=SamplingParams(temperature=1.0, max_new_tokens=128),
        max_context=4096,
    )
    run_id = gateway.new_run(runtime)
    episode = gateway.new_episode(run_id)
    messages: list[dict[str, Any]] = list(QUESTION)
    async with client_for(gateway, episode) as client:
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        # The family's call format was parsed into an OpenAI tool call.
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "lookup"
        assert json.loads(call.function.arguments) == {"key": "ann.pet"}
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "rex"})
        second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == FINAL

    path = gateway.call(gateway.turns.path(turn_of(second)))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]
    assert path[1].id == turn_of(first)
    for answer in (first, second):
        turn = turn_of(answer)
        context = gateway.call(gateway.turns.context(turn))
        assert engine.seen(turn.hex) == list(context.token_ids)
    # The second request's context holds the first answer exactly as it was sampled,
    # Qwen3's thought included, though the template would drop it on a re-render.
    first_answer = list(path[1].token_ids)
    context = list(gateway.call(gateway.turns.context(turn_of(second))).token_ids)
    at = len(path[0].token_ids)
    assert context[at : at + len(first_answer)] == first_answer


@pytest.mark.parametrize("history", ["append", "rerender"])
async def test_qwen3_history_appended_or_rerendered(gateway: Any, history: str) -> None:
    """A new question after a tool loop: Qwen3's template drops the earlier thoughts.
    `append` keeps one path (contexts exactly as sampled); `rerender` gives each request
    the template's own rendering, so the third request branches after the prompt."""
    template = template_for("qwen3")
    replies = scripted_replies(template, "qwen3")
    replies.append([*template.tokenizer.encode("No other pets."), template.stop_ids[-1]])
    engine = MockEngine(replay(replies), vocab_size=len(template.tokenizer.hf))
    runtime = PolicyRuntime(
        engine=engine,
        template=template,
        model_name=f"qwen3-{history}",
        sampling=SamplingParams(max_new_tokens=128),
        max_context=4096,
        history=history,  # type: ignore[arg-type]
    )
    episode = gateway.new_episode(gateway.new_run(runtime))
    messages: list[dict[str, Any]] = list(QUESTION)
    async with client_for(gateway, episode) as client:
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        (call,) = first.choices[0].message.tool_calls or []
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "rex"})
        second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        messages.append(second.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Any other pets?"})
        third = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)

    path = gateway.call(gateway.turns.path(turn_of(third)))
    context = list(gateway.call(gateway.turns.context(turn_of(third))).token_ids)
    assert engine.seen(turn_of(third).hex) == context  # either way: what the engine saw
    text = template.tokenizer.decode(context)
    if history == "append":
        assert [t.kind for t in path] == ["prompt", "policy", "env", "policy", "env", "policy"]
        assert "I should look it up." in text  # the thought stays where it was sampled
    else:
        assert [t.kind for t in path] == ["prompt", "env", "policy"]
        rendered = template.render(messages, tools=TOOLS).token_ids
        assert context[: len(rendered)] == rendered  # the template's own rendering
        assert "I should look it up." not in text
        # The earlier answers are still recorded, on the branch they were sampled on.
        tree = gateway.call(gateway.turns.episode_tree(episode))
        assert len(tree.roots[0].children) == 2
