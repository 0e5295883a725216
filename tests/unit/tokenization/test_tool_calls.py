from __future__ import annotations

import json

import pytest

from agentflow.tokenization import ToolCall, parse_tool_calls, render_tool_call
from agentflow.tokenization.tool_calls import TOOL_CALL_STYLES, style_of_template


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


@pytest.mark.parametrize("style", TOOL_CALL_STYLES)
def test_render_then_parse(style):
    openai_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "search", "arguments": json.dumps({"q": "ü"})},
    }
    text = render_tool_call(openai_call, style)
    # A Llama 3 call is the whole answer; the other formats may follow text.
    parsed = parse_tool_calls(text if style == "llama3_json" else "pre " + text, style)
    assert parsed.tool_calls[0].name == "search"
    assert parsed.tool_calls[0].arguments == {"q": "ü"}
    assert parsed.tool_calls[0].to_openai()["function"]["name"] == "search"


def test_unknown_style():
    with pytest.raises(ValueError):
        parse_tool_calls("x", "xml")  # type: ignore[arg-type]


def calls(text: str, style: str) -> list[tuple[str, dict]]:
    parsed = parse_tool_calls(text, style)  # type: ignore[arg-type]
    return [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize(
    ("style", "text", "want", "content"),
    [
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
            [("f", {"x": 1}), ("g", {})],
            "",
        ),
        ("llama3_json", '{"name": "f", "parameters": {"s": "a;b}"}}', [("f", {"s": "a;b}"})], ""),
        ("llama3_json", "The pet is rex.", [], "The pet is rex."),
        (
            "mistral",
            'ok[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "abcdefghi"}]',
            [("f", {"x": 1})],
            "ok",
        ),
        (
            "mistral",
            '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}',
            [("f", {"x": 1}), ("g", {})],
            "",
        ),
        (
            "deepseek",
            "hm<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
            '{"x": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            [("f", {"x": 1})],
            "hm",
        ),
        (
            "deepseek",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜>'
            "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            [("f", {"x": 1}), ("g", {})],
            "",
        ),
    ],
)
def test_family_formats_parse(style, text, want, content):
    assert calls(text, style) == want
    assert parse_tool_calls(text, style).content == content


@pytest.mark.parametrize(
    ("style", "text"),
    [
        ("llama3_json", '{"name": "f", "parameters": {"x": }'),
        ("mistral", "[TOOL_CALLS][{broken"),
        ("deepseek", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{nope<｜tool▁call▁end｜>"),
    ],
)
def test_malformed_family_calls_are_errors(style, text):
    parsed = parse_tool_calls(text, style)
    assert parsed.tool_calls == [] and len(parsed.errors) == 1


def test_the_format_is_read_off_the_template():
    assert style_of_template("{{ '<tool_call>' }}") == "hermes"
    assert style_of_template("{{- '<|python_tag|>' + name }}") == "llama3_json"
    assert style_of_template('{{- "[TOOL_CALLS][" }}') == "mistral"
    assert style_of_template("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>") == "deepseek"
