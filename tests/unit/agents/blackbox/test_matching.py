"""Longest-prefix matching of chat requests against turn trees (no database, no engine)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from agentflow.agents.blackbox.matching import (
    assistant_view,
    match_request,
    split_at_assistants,
    tool_call_id,
)
from agentflow.errors import InvalidInput
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.types import TurnNode

TEMPLATE = ByteChatTemplate()
TOK = TEMPLATE.tokenizer
END = TOK.end_id
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
FIRST = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ann's pet?"}]


def node(kind: str, tokens: list[int], *children: TurnNode) -> TurnNode:
    n = len(tokens)
    policy = kind == "policy"
    return TurnNode(
        id=uuid.uuid4(),
        episode_id=uuid.UUID(int=0),
        parent_id=None,
        depth=0,
        kind=kind,  # type: ignore[arg-type]
        token_ids=tuple(tokens),
        logprobs=(0.0,) * n if policy else None,
        weight_versions=(0,) * n if policy else None,
        loss_mask=(int(policy),) * n,
        text=None,
        reward=None,
        finish_reason=None,
        timings={},
        created_at=datetime.now(UTC),
        children=tuple(children),
    )


def echo(turn: TurnNode, *, with_ids: bool = True) -> dict[str, Any]:
    """The assistant message an OpenAI client sends back for `turn`'s answer."""
    view = assistant_view(TEMPLATE, turn.token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": view.content or None}
    if view.tool_calls:
        message["tool_calls"] = [
            {
                "id": tool_call_id(turn.id.hex, i) if with_ids else f"x{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(view.tool_calls)
        ]
    return message


def call_output(key: str) -> list[int]:
    call = json.dumps({"name": "lookup", "arguments": {"key": key}})
    text = f"<|tool_call|>{call}<|/tool_call|>"
    return [*TOK.encode(text, allow_special=True), END]


TOOL_MSG = {"role": "tool", "tool_call_id": "c", "content": "bob"}


def linear_tree() -> tuple[TurnNode, TurnNode, TurnNode]:
    """prompt -> policy (a tool call) -> env (the tool's answer), built as a loop would."""
    output = call_output("ann.friend")
    env = node("env", TEMPLATE.render_delta([TOOL_MSG], after=output).token_ids)
    policy = node("policy", output, env)
    prompt = node("prompt", TEMPLATE.render(FIRST, tools=TOOLS).token_ids, policy)
    return prompt, policy, env


def test_first_request_is_a_new_root() -> None:
    found = match_request(TEMPLATE, [], FIRST, TOOLS)
    assert found.parent is None
    assert found.new_tokens == TEMPLATE.render(FIRST, tools=TOOLS).token_ids


def test_echoed_conversation_follows_the_recorded_path() -> None:
    prompt, policy, env = linear_tree()
    found = match_request(TEMPLATE, [prompt], [*FIRST, echo(policy), TOOL_MSG], TOOLS)
    assert [t.id for t in found.path] == [prompt.id, policy.id, env.id]
    assert found.new_tokens == []


def test_next_turn_continues_with_only_the_new_tokens() -> None:
    prompt, policy, env = linear_tree()
    second = node("policy", [*TOK.encode("answer owl"), END])
    env = node("env", env.token_ids, second)
    policy = node("policy", policy.token_ids, env)
    prompt = node("prompt", prompt.token_ids, policy)
    policy_echo = echo(policy)
    policy_echo["tool_calls"][0]["id"] = tool_call_id(policy.id.hex, 0)
    user = {"role": "user", "content": "wrong"}
    messages = [*FIRST, policy_echo, TOOL_MSG, echo(second), user]
    found = match_request(TEMPLATE, [prompt], messages, TOOLS)
    assert [t.id for t in found.path] == [prompt.id, policy.id, env.id, second.id]
    assert found.new_tokens == TEMPLATE.render_delta([user], after=second.token_ids).token_ids


def test_edited_first_message_starts_a_new_root() -> None:
    prompt, policy, _ = linear_tree()
    edited = [FIRST[0], {"role": "user", "content": "bob's pet?"}]
    found = match_request(TEMPLATE, [prompt], [*edited, echo(policy), TOOL_MSG], TOOLS)
    assert found.path == []
    # Nothing after the edit is a policy sample any more: all of it is the new segment.
    full = TEMPLATE.render([*edited, echo(policy), TOOL_MSG], tools=TOOLS).token_ids
    assert found.new_tokens == full


def test_edited_tool_result_branches_under_the_policy_turn() -> None:
    prompt, policy, env = linear_tree()
    other = {**TOOL_MSG, "content": "cy"}
    found = match_request(TEMPLATE, [prompt], [*FIRST, echo(policy), other], TOOLS)
    assert [t.id for t in found.path] == [prompt.id, policy.id]
    assert found.new_tokens == TEMPLATE.render_delta([other], after=policy.token_ids).token_ids
    assert tuple(found.new_tokens) != env.token_ids


def test_rewritten_assistant_message_is_not_taken_for_the_policy_turn() -> None:
    prompt, policy, _ = linear_tree()
    rewritten = {"role": "assistant", "content": "let me think"}
    found = match_request(TEMPLATE, [prompt], [*FIRST, rewritten, TOOL_MSG], TOOLS)
    assert [t.id for t in found.path] == [prompt.id]
    body = [*TOK.encode("let me think"), END]
    assert found.new_tokens == body + TEMPLATE.render_delta([TOOL_MSG], after=body).token_ids


def test_undecodable_output_still_matches_its_echo() -> None:
    output = [0xFF, 0xC3, *TOK.encode(" <|user|> x"), TOK.role_id("user")]  # cut, no end token
    policy = node("policy", output)
    prompt = node("prompt", TEMPLATE.render(FIRST).token_ids, policy)
    user = {"role": "user", "content": "go on"}
    found = match_request(TEMPLATE, [prompt], [*FIRST, echo(policy), user])
    assert [t.id for t in found.path] == [prompt.id, policy.id]
    # A turn cut by the length limit is closed before the next message, as in the loop.
    assert found.new_tokens[0] == END


def test_echoed_call_id_picks_its_turn_among_equal_samples() -> None:
    first, second = node("policy", call_output("ann.pet")), node("policy", call_output("ann.pet"))
    prompt = node("prompt", TEMPLATE.render(FIRST, tools=TOOLS).token_ids, first, second)
    found = match_request(TEMPLATE, [prompt], [*FIRST, echo(first), TOOL_MSG], TOOLS)
    assert found.path[-1].id == first.id
    found = match_request(
        TEMPLATE, [prompt], [*FIRST, echo(first, with_ids=False), TOOL_MSG], TOOLS
    )
    assert found.path[-1].id == second.id  # no id to go by: the newest sample


def test_repeated_request_resamples_under_the_same_segment() -> None:
    prompt, policy, env = linear_tree()
    again = match_request(TEMPLATE, [prompt], FIRST, TOOLS)
    assert [t.id for t in again.path] == [prompt.id] and again.new_tokens == []


def test_split_at_assistants() -> None:
    a = {"role": "assistant", "content": "x"}
    parts = split_at_assistants([FIRST[0], a, a, FIRST[1]])
    assert parts == [[FIRST[0]], [a], [], [a], [FIRST[1]]]


def test_malformed_call_is_shown_as_text() -> None:
    output = [*TOK.encode("<|tool_call|>{oops<|/tool_call|>", allow_special=True), END]
    view = assistant_view(TEMPLATE, output)
    assert view.tool_calls == () and view.parse_errors and "{oops" in view.content


def test_template_that_rewrites_history_is_refused() -> None:
    class Rewriting(ByteChatTemplate):
        def render(self, messages, *, tools=None, add_generation_prompt=True):  # type: ignore[no-untyped-def]
            out = super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
            if not add_generation_prompt:
                out.token_ids[0] = 1  # a template whose history depends on what follows
            return out

    with pytest.raises(InvalidInput):
        match_request(Rewriting(), [], [*FIRST, {"role": "assistant", "content": "x"}, FIRST[1]])
