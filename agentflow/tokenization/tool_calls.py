"""Tool calls in model output, in the formats of the model families the gateway serves.

    agentflow    <|tool_call|>{"name": "guess", "arguments": {"n": 8}}<|/tool_call|>
    hermes       <tool_call>\\n{"name": "guess", "arguments": {"n": 8}}\\n</tool_call>
                 (Qwen 2.5/3, Hermes)
    llama3_json  {"name": "guess", "parameters": {"n": 8}}, the whole answer, optionally
                 after <|python_tag|>; several calls separated by `;` (Llama 3.1-3.3)
    mistral      [TOOL_CALLS][{"name": "guess", "arguments": {"n": 8}, "id": "..."}], or
                 [TOOL_CALLS]guess[ARGS]{"n": 8} per call (newer Mistral tokenizers)
    deepseek     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>guess
                 ```json {"n": 8} ```<｜tool▁call▁end｜><｜tool▁calls▁end｜> (V3), or
                 <｜tool▁call▁begin｜>guess<｜tool▁sep｜>{"n": 8}<｜tool▁call▁end｜> (V3.1+)

Each call is a name and JSON-object arguments (a JSON string of an object is accepted, as
OpenAI sends it). Parsing never raises on bad model output: a call that is not valid JSON
or lacks a name is reported in `errors` (the env or agent decides what a malformed call
costs), and the text outside the calls is the message content. `style_of_template` picks
a format from a chat template's text, for checkpoints whose config names none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ToolCallStyle = Literal["agentflow", "hermes", "llama3_json", "mistral", "deepseek"]
TOOL_CALL_STYLES: tuple[ToolCallStyle, ...] = (
    "agentflow",
    "hermes",
    "llama3_json",
    "mistral",
    "deepseek",
)

MARKERS: dict[str, tuple[str, str]] = {
    "agentflow": ("<|tool_call|>", "<|/tool_call|>"),
    "hermes": ("<tool_call>", "</tool_call>"),
}
# A call between a style's markers, compiled once (this runs on every answer). An unclosed
# call at the end (generation cut by the length limit) is still a call body.
_MARKED_CALL = {
    style: re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|\Z)", re.S)
    for style, (start, end) in MARKERS.items()
}
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"

# Text that opens the calls of an answer, per style: content streams up to it.
CALL_OPENERS: dict[str, tuple[str, ...]] = {
    "agentflow": ("<|tool_call|>",),
    "hermes": ("<tool_call>",),
    "llama3_json": (PYTHON_TAG, "{"),  # a JSON answer is a call; `{` opens it
    "mistral": (MISTRAL_CALLS,),
    "deepseek": (DS_CALLS_BEGIN, DS_CALL_BEGIN),
}


def style_of_template(template: str) -> ToolCallStyle:
    """The tool-call format a chat template teaches its model (Hermes when it shows none)."""
    if DS_CALL_BEGIN in template or "tool▁call▁begin" in template:
        return "deepseek"
    if MISTRAL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or '"parameters": ' in template:
        return "llama3_json"
    return "hermes"


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
    if style == "llama3_json":
        return _parse_llama3_json(text)
    if style == "mistral":
        return _parse_mistral(text)
    if style == "deepseek":
        return _parse_deepseek(text)
    pattern = _MARKED_CALL.get(style)
    if pattern is None:
        raise ValueError(f"unknown tool-call style {style!r}")
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


def _collect(bodies: list[tuple[str | None, str]], content: str) -> ParsedAssistant:
    """Calls from `(name or None, JSON body)` pairs: with a name, the body is the
    arguments; without, an object holding `name` and `arguments`/`parameters`."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for name, body in bodies:
        index = len(calls) + len(errors)
        if name is None:
            call, error = _one_call(body, index)
        else:
            call, error = _named_call(name, body, index)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    return ParsedAssistant(content=content.strip(), tool_calls=calls, errors=errors)


def _parse_llama3_json(text: str) -> ParsedAssistant:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    if not (tagged or body.startswith("{")):
        return ParsedAssistant(content=text.strip())
    # One object, or several separated by `;` (Llama 3.1's parallel calls).
    pieces = [p.strip() for p in _split_top_level(body, ";") if p.strip()]
    return _collect([(None, p) for p in pieces], "")


def _parse_mistral(text: str) -> ParsedAssistant:
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return ParsedAssistant(content=text.strip())
    content, rest = text[:at], text[at:]
    bodies: list[tuple[str | None, str]] = []
    for chunk in rest.split(MISTRAL_CALLS)[1:]:
        chunk = chunk.strip()
        if chunk.startswith("["):  # v3: a JSON list of call objects
            try:
                items = json.loads(chunk)
            except json.JSONDecodeError:
                bodies.append((None, chunk))  # reported as not JSON below
                continue
            if not isinstance(items, list):
                items = [items]
            bodies += [(None, json.dumps(item)) for item in items]
        elif MISTRAL_ARGS in chunk:  # v11+: name[ARGS]{...}
            name, _, args = chunk.partition(MISTRAL_ARGS)
            bodies.append((name.strip(), args.strip()))
        else:
            bodies.append((None, chunk))
    return _collect(bodies, content)


_FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _parse_deepseek(text: str) -> ParsedAssistant:
    at = min(
        (i for i in (text.find(DS_CALLS_BEGIN), text.find(DS_CALL_BEGIN)) if i >= 0), default=-1
    )
    if at < 0:
        return ParsedAssistant(content=text.strip())
    content = text[:at]
    bodies: list[tuple[str | None, str]] = []
    for chunk in text[at:].split(DS_CALL_BEGIN)[1:]:
        call = chunk.split(DS_CALL_END)[0]
        head, sep, args = call.partition(DS_SEP)
        if not sep:
            bodies.append((None, call))
            continue
        if head.strip() == "function" and "\n" in args:  # V3: function<sep>name\n```json ...```
            name, _, args = args.partition("\n")
        else:  # V3.1+: name<sep>{...}
            name = head
        fenced = _FENCED.match(args)
        bodies.append((name.strip(), fenced.group(1) if fenced else args.strip()))
    return _collect(bodies, content)


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _named_call(name: str, body: str, index: int) -> tuple[ToolCall | None, str]:
    if not name:
        return None, f"tool call {index}: missing name"
    try:
        args = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        return None, f"tool call {index} ({name}): arguments are not JSON ({e.msg})"
    if not isinstance(args, Mapping):
        return None, f"tool call {index} ({name}): arguments must be an object"
    return ToolCall(id=f"call_{index}", name=name, arguments=dict(args)), ""


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
    if style == "llama3_json":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    if style == "mistral":
        return MISTRAL_CALLS + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
    if style == "deepseek":
        body = json.dumps(args, ensure_ascii=False)
        one = f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{body}\n```{DS_CALL_END}"
        return f"{DS_CALLS_BEGIN}{one}{DS_CALLS_END}"
    start, end = MARKERS[style]
    payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{start}\n{payload}\n{end}" if style == "hermes" else f"{start}{payload}{end}"
