"""`stream=true`: the answer as OpenAI `chat.completion.chunk` server-sent events.

The engine protocol returns whole generations, so the chunks are sent once the policy
turn is generated and recorded: tokens and log-probs are stored exactly as without
streaming, and a client that reads the stream sees the same message. Content goes out
in pieces of `piece_chars` characters, tool calls as OpenAI
sends them (one chunk with id and name, one with the arguments), then a chunk with the
finish reason, the usage chunk when `stream_options.include_usage` asks for it, and
`data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from agentflow.agents.blackbox.proxy import ChatAnswer
from agentflow.agents.blackbox.responses import extension_of, message_of, usage_of


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _content_pieces(content: str, size: int) -> list[str]:
    return [content[i : i + size] for i in range(0, len(content), size)]


def stream_chunks(
    answer: ChatAnswer,
    *,
    include_usage: bool = False,
    piece_chars: int = 16,
) -> Iterator[bytes]:
    base = {
        "id": f"chatcmpl-{answer.turn_id.hex}",
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
        "system_fingerprint": None,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _event({**base, "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    for piece in _content_pieces(message_of(answer)["content"] or "", piece_chars):
        yield chunk({"content": piece})
    for index, call in enumerate(message_of(answer).get("tool_calls", [])):
        head = {"index": index, "id": call["id"], "type": "function"}
        yield chunk(
            {
                "tool_calls": [
                    {**head, "function": {"name": call["function"]["name"], "arguments": ""}}
                ]
            }
        )
        args = call["function"]["arguments"]
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
    yield chunk({}, answer.finish_reason, agentflow=extension_of(answer))
    if include_usage:
        yield _event({**base, "choices": [], "usage": usage_of(answer)})
    yield b"data: [DONE]\n\n"
