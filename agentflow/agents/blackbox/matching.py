"""Match a chat request against an episode's turn tree by longest token prefix.

A black-box agent resends its whole conversation on every request. Rendering it again
from text would not reproduce the tokens the model actually produced (a sampled token
sequence need not survive decode and re-encode), so the request is turned into tokens the
way the white-box loop builds a context:

    render(messages before the 1st assistant, tools)   a `prompt` segment
    + the policy turn's own token ids                  for an assistant message we answered
    + render_delta(messages up to the next assistant, after=those ids)
    + ...

An assistant message stands for a recorded policy turn when it says what we answered
for that turn (same content and tool calls; see `assistant_view`). Walking from the
root, each child whose whole segment is a prefix of what remains is followed; the node
reached is the parent of the new turn and the rest of the tokens (possibly none) are
the new turn. A request that edits an earlier message therefore stops at the deepest
node before the edit and starts a sibling there: recorded paths are never changed.
Once the walk has left the tree, assistant messages are rendered from their text
(those tokens are not samples of the policy, so they go into a non-policy turn).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentflow.errors import InvalidInput
from agentflow.tokenization.chat import ChatTemplate
from agentflow.tokenization.tool_calls import ToolCall
from agentflow.types import TurnNode

Message = Mapping[str, Any]
# A policy turn's `finish_reason` when a stop string ended it: its text is the answer.
STOP_STRING = "stop_string"


@dataclass(frozen=True)
class AssistantView:
    """What the gateway answers for a policy turn's output ids, and what it expects back."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    parse_errors: tuple[str, ...] = ()


def tool_call_id(turn_hex: str, index: int, style: str | None = None) -> str:
    """Ids name their policy turn, so an echoed call finds its turn among equal siblings.
    Mistral's templates take only 9 letters and digits."""
    if style == "mistral":
        return f"{turn_hex[:7]}{index % 100:02d}"
    return f"call_{turn_hex[:24]}_{index}"


def assistant_view(
    template: ChatTemplate, output_ids: Sequence[int], *, parse_calls: bool = True
) -> AssistantView:
    """The assistant message for `output_ids`: parsed tool calls, or the raw text when
    tools are off or a call is malformed (the agent then sees exactly what was written)."""
    stops = set(template.stop_ids)
    ids = list(output_ids)
    while ids and ids[-1] in stops:
        ids.pop()
    raw = template.tokenizer.decode(ids).strip()
    if not parse_calls:
        return AssistantView(content=raw)
    parsed = template.parse_assistant(output_ids)
    if parsed.errors:
        return AssistantView(content=raw, parse_errors=tuple(parsed.errors))
    return AssistantView(content=parsed.content, tool_calls=tuple(parsed.tool_calls))


def _style(template: ChatTemplate) -> str | None:
    style: str | None = getattr(template, "tool_call_style", None)
    return style


def _calls_of(message: Message) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments") or "{}"
        calls.append((fn["name"], json.loads(args) if isinstance(args, str) else args))
    return calls


def _says(message: Message, view: AssistantView) -> bool:
    if (message.get("content") or "").strip() != view.content:
        return False
    return _calls_of(message) == [(c.name, c.arguments) for c in view.tool_calls]


def _answered_by(
    template: ChatTemplate, children: Sequence[TurnNode], message: Message
) -> TurnNode | None:
    """The policy child whose answer `message` repeats; an echoed call id decides ties."""
    ids = {c.get("id") for c in message.get("tool_calls") or ()}
    found: list[TurnNode] = []
    for child in children:
        if child.kind != "policy":
            continue
        if child.finish_reason == STOP_STRING:  # the answer was the text before the stop
            views: Any = [AssistantView(content=child.text or "")]
        else:
            views = (assistant_view(template, child.token_ids, parse_calls=p == 1) for p in (1, 0))
        if any(_says(message, v) for v in views):
            if tool_call_id(child.id.hex, 0, _style(template)) in ids:
                return child
            found.append(child)
    return found[-1] if found else None  # the newest: most likely the answer just sent


def _assistant_body(
    template: ChatTemplate,
    before: Sequence[Message],
    message: Message,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    """Tokens of an assistant message after the generation prompt that opened it."""
    opened = template.render(before, tools=tools).token_ids
    full = template.render([*before, message], tools=tools, add_generation_prompt=False)
    if full.token_ids[: len(opened)] != opened:
        raise InvalidInput(
            "the chat template renders this assistant message differently from its "
            "generation prompt; it cannot be matched as a continuation",
            field="messages",
        )
    return full.token_ids[len(opened) :]


def _follow(
    result: Match, children: Sequence[TurnNode], pending: list[int]
) -> tuple[Sequence[TurnNode], bool, list[int]]:
    """Follow the non-policy children whose whole segment `pending` starts with. The walk
    has left the tree once no child's segment can still start with what is left (a
    segment may span several messages, e.g. an assistant message the agent wrote)."""
    while pending:
        whole = [c for c in children if c.kind != "policy" and c.token_ids]
        child = next((c for c in whole if tuple(pending[: len(c.token_ids)]) == c.token_ids), None)
        if child is None:
            head = tuple(pending)
            alive = any(c.token_ids[: len(head)] == head for c in whole)
            return children, not alive, pending
        result.path.append(child)
        children = child.children
        pending = pending[len(child.token_ids) :]
    return children, False, pending


@dataclass
class Match:
    path: list[TurnNode] = field(default_factory=list)  # matched turns, root first
    new_tokens: list[int] = field(default_factory=list)  # the unmatched remainder

    @property
    def parent(self) -> TurnNode | None:
        return self.path[-1] if self.path else None


def split_at_assistants(messages: Sequence[Message]) -> list[list[Message]]:
    """[group, [assistant], group, [assistant], ..., group]: groups may be empty."""
    parts: list[list[Message]] = [[]]
    for message in messages:
        if message["role"] == "assistant":
            parts += [[message], []]
        else:
            parts[-1].append(message)
    return parts


def match_rendered(
    template: ChatTemplate,
    roots: Sequence[TurnNode],
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Match:
    """`chat_history = "rerender"`: the request's tokens are the template's rendering of
    the whole conversation (generation prompt included), and the tree is walked with them
    by whole segments of any kind. Where the template rewrote history (Qwen3 drops the
    thought of an earlier answer), the recorded turn no longer matches, the walk stops
    before it, and the rest of the rendering starts a branch there: every context is
    what the template makes of the conversation, and the earlier answers' samples stay
    on their own paths."""
    pending = list(template.render(messages, tools=tools).token_ids)
    result = Match()
    children: Sequence[TurnNode] = roots
    while pending:
        child = next(
            (
                c
                for c in children
                if c.token_ids and tuple(pending[: len(c.token_ids)]) == c.token_ids
            ),
            None,
        )
        if child is None:
            break
        result.path.append(child)
        children = child.children
        pending = pending[len(child.token_ids) :]
    result.new_tokens = pending
    return result


def match_request(
    template: ChatTemplate,
    roots: Sequence[TurnNode],
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    rerender: bool = False,
) -> Match:
    """Walk `roots` with the request's tokens; see the module docstring (`rerender`:
    see `match_rendered`)."""
    if rerender:
        return match_rendered(template, roots, messages, tools)
    result = Match()
    children: Sequence[TurnNode] = roots
    pending: list[int] = []
    left_tree = False
    last_output: list[int] = []
    seen: list[Message] = []
    for index, part in enumerate(split_at_assistants(messages)):
        if index % 2 == 1:  # one assistant message
            message = part[0]
            # A policy turn can only follow a whole matched segment.
            child = None if left_tree or pending else _answered_by(template, children, message)
            if child is not None:
                result.path.append(child)
                children = child.children
                last_output = list(child.token_ids)
                seen.append(message)
                continue
            last_output = _assistant_body(template, seen, message, tools)
            pending += last_output
            seen.append(message)
        elif index == 0:
            pending += template.render(part, tools=tools).token_ids
            seen += part
        else:
            pending += template.render_delta(part, after=last_output).token_ids
            seen += part
        if not left_tree:
            children, left_tree, pending = _follow(result, children, pending)
    result.new_tokens = pending
    return result
