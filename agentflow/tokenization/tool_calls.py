"""Tool calls in model output: the project's own format and the Hermes/Qwen format.

    own     <|tool_call|>{"name": "guess", "arguments": {"n": 8}}<|/tool_call|>
    hermes  <tool_call>\\n{"name": "guess", "arguments": {"n": 8}}\\n</tool_call>

Both carry one JSON object per call with `name` and `arguments` (an object, or a JSON
string of one, as OpenAI sends it). Parsing never raises on bad model output: a call
that is not valid JSON or lacks a name is reported in `errors` (the env or agent decides
what a malformed call costs), and the text outside the markers is the message content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ToolCallStyle = Literal["agentflow", "hermes"]

MARKERS: dict[str, tuple[str, str]] = {
    "agentflow": ("<|tool_call|>", "<|/tool_call|>"),
    "hermes": ("<tool_call>", "</tool_call>"),
}


class ToolCall(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


class ParsedAssistant(BaseModel):
    content: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list, description="malformed calls, in order")


def parse_tool_calls(text: str, style: ToolCallStyle = "agentflow") -> ParsedAssistant:
    """Split `text` into content and tool calls written in `style`."""
    if style not in MARKERS:
        raise ValueError(f"unknown tool-call style {style!r}")
    start, end = MARKERS[style]
    # An unclosed call at the end (generation cut by the length limit) is still a call body.
    pattern = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|\Z)", re.S)
    calls: list[ToolCall] = []
    errors: list[str] = []
    content_parts: list[str] = []
    pos = 0
    for m in pattern.finditer(text):
        content_parts.append(text[pos : m.start()])
        pos = m.end()
        body = m.group(1).strip()
        call, error = _one_call(body, index=len(calls) + len(errors))
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content_parts.append(text[pos:])
    return ParsedAssistant(content="".join(content_parts).strip(), tool_calls=calls, errors=errors)


def _one_call(body: str, index: int) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call {index}: not JSON ({e.msg} at char {e.pos}): {body[:80]!r}"
    if not isinstance(obj, Mapping):
        return None, f"tool call {index}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"tool call {index}: missing string 'name'"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"tool call {index} ({name}): arguments are not JSON ({e.msg})"
    if not isinstance(args, Mapping):
        return None, f"tool call {index} ({name}): arguments must be an object"
    raw_id = obj.get("id")
    call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
    return ToolCall(id=call_id, name=name, arguments=dict(args)), ""


def render_tool_call(call: ToolCall | Mapping[str, Any], style: ToolCallStyle = "agentflow") -> str:
    """The text of one call in `style` (what a model trained on the format would emit)."""
    if isinstance(call, ToolCall):
        name, args = call.name, call.arguments
    else:  # OpenAI shape {"function": {"name", "arguments"}} or flat {"name", "arguments"}
        fn = call.get("function", call)
        name, args = fn["name"], fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
    start, end = MARKERS[style]
    payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{start}\n{payload}\n{end}" if style == "hermes" else f"{start}{payload}{end}"
