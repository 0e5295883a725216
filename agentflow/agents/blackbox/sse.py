"""`stream=true`: the answer as OpenAI `chat.completion.chunk` server-sent events, sent
while the engine generates it.

The proxy shows the output tokens as the engine makes them (`TokenObserver`); this module
turns them into content deltas. Text is sent only where it can no longer change: the
answer's content is stripped, ends at the first stop string and stops at the first
tool-call marker, so a delta holds back trailing whitespace, a tail that could still
become a stop string or a marker, and an unfinished UTF-8 character. When the turn is
recorded, the rest of the content goes out, then the tool calls as OpenAI sends them
(one chunk with id and name, one with the arguments), a chunk with the finish reason,
the usage chunk when `stream_options.include_usage` asks for it, and `data: [DONE]`.
What a client assembles is the non-streamed answer, and the recorded tokens are the same.

Log-probs (`logprobs: true`) ride in the chunks, one entry per token: as the tokens come,
except the last few while a stop string could still cut them (and all of them when
`top_logprobs` is asked: those come from the finished answer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentflow.agents.blackbox.proxy import ChatAnswer
from agentflow.agents.blackbox.responses import extension_of, message_of, token_entries, usage_of
from agentflow.agents.blackbox.stops import first_stop
from agentflow.tokenization.chat import ChatTemplate
from agentflow.tokenization.tool_calls import CALL_OPENERS


def event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def _held_tail(text: str, prefixes_of: Sequence[str]) -> int:
    """Length of the longest tail of `text` that starts one of `prefixes_of`."""
    longest = 0
    for word in prefixes_of:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if word.startswith(text[-n:]):
                longest = n
                break
    return longest


@dataclass
class ContentStream:
    """The content deltas of an answer whose output tokens arrive in pieces."""

    template: ChatTemplate
    stops: Sequence[str] = ()
    parse_calls: bool = True
    ids: list[int] = field(default_factory=list)
    sent: str = ""
    closed: bool = False  # a stop string or a tool call began: no more content streams

    def feed(self, ids: Sequence[int]) -> str:
        """Add output tokens; the content that became certain."""
        self.ids.extend(ids)
        if self.closed:
            return ""
        body = [t for t in self.ids if t not in self.template.stop_ids]
        text = self.template.tokenizer.decode(body).lstrip().rstrip("\ufffd")
        ends = [first_stop(text, self.stops)] if self.stops else []
        watch = list(self.stops)
        if self.parse_calls:
            for marker in CALL_OPENERS[getattr(self.template, "tool_call_style", "hermes")]:
                ends.append(text.find(marker) if marker in text else None)
                watch.append(marker)
        cut = min((e for e in ends if e is not None), default=None)
        if cut is not None:
            text, self.closed = text[:cut], True
        else:
            text = text[: len(text) - _held_tail(text, watch)]
        text = text.rstrip()
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def rest(self, content: str) -> str:
        """What the finished answer's `content` adds to what was sent."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


@dataclass
class ChunkWriter:
    """Chunks of one answer: the same id, model and creation time on each."""

    chat_id: str
    model: str
    created: int
    with_logprobs: bool = False

    def chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> bytes:
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return self._event([choice], **extra)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return event(
            {
                "id": self.chat_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
                "choices": choices,
                **extra,
            }
        )

    def finish(
        self,
        answer: ChatAnswer,
        stream: ContentStream,
        logprobs_sent: int,
        *,
        include_usage: bool,
    ) -> list[bytes]:
        """The chunks after the last token: the rest of the content and log-probs, the
        tool calls, the finish reason, the usage."""
        out: list[bytes] = []
        message = message_of(answer)
        rest = stream.rest(message["content"] or "")
        entries = token_entries(answer)[logprobs_sent:] if self.with_logprobs else []
        if rest or entries:
            out.append(self.chunk({"content": rest}, logprobs=entries or None))
        for index, call in enumerate(message.get("tool_calls", [])):
            head = {"index": index, "id": call["id"], "type": "function"}
            name = call["function"]["name"]
            out.append(
                self.chunk({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})
            )
            args = call["function"]["arguments"]
            out.append(
                self.chunk({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
            )
        out.append(self.chunk({}, answer.finish_reason, agentflow=extension_of(answer)))
        if include_usage:  # OpenAI's usage chunk: no choices
            out.append(self._event([], usage=usage_of(answer)))
        out.append(DONE)
        return out
