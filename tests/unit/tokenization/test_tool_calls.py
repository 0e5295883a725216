from __future__ import annotations

import json

import pytest

from agentflow.tokenization import ToolCall, parse_tool_calls, render_tool_call


def test_own_format():
    text = 'Let me guess.<|tool_call|>{"name": "guess", "arguments": {"n": 8}}<|/tool_call|>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me guess."
    assert parsed.tool_calls == [ToolCall(id="call_0", name="guess", arguments={"n": 8})]
    assert parsed.errors == []


def test_hermes_format_several_calls():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.tool_calls[1].arguments == {"x": 1}
    assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert parsed.content == ""


def test_plain_text_has_no_calls():
    parsed = parse_tool_calls("just words <tool_call", "hermes")
    assert parsed.tool_calls == [] and parsed.errors == []
    assert parsed.content == "just words <tool_call"


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arguments": {}}', "missing string 'name'"),
        ('{"name": "f", "arguments": "{bad"}', "arguments are not JSON"),
        ('{"name": "f", "arguments": [1]}', "must be an object"),
    ],
)
def test_malformed_calls_are_reported_not_raised(body, message):
    parsed = parse_tool_calls(f"x<tool_call>{body}</tool_call>y", "hermes")
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and message in parsed.errors[0]
    assert parsed.content == "xy"


def test_unclosed_call_at_the_end_is_still_parsed():
    parsed = parse_tool_calls('<|tool_call|>{"name": "f", "arguments": {"a": 1}}')
    assert parsed.tool_calls[0].arguments == {"a": 1}


@pytest.mark.parametrize("style", ["agentflow", "hermes"])
def test_render_then_parse(style):
    openai_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "search", "arguments": json.dumps({"q": "ü"})},
    }
    text = render_tool_call(openai_call, style)
    parsed = parse_tool_calls("pre " + text, style)
    assert parsed.tool_calls[0].name == "search"
    assert parsed.tool_calls[0].arguments == {"q": "ü"}
    assert parsed.tool_calls[0].to_openai()["function"]["name"] == "search"


def test_unknown_style():
    with pytest.raises(ValueError):
        parse_tool_calls("x", "xml")  # type: ignore[arg-type]
