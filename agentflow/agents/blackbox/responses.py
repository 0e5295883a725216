"""OpenAI `chat.completion` objects built from a `ChatAnswer`.

Besides OpenAI's fields the answer carries `agentflow` (the policy turn and the turn it
continues), which OpenAI clients ignore and tools that inspect the turn tree can use.
"""

from __future__ import annotations

from typing import Any

from agentflow.agents.blackbox.matching import tool_call_id
from agentflow.agents.blackbox.proxy import ChatAnswer


def message_of(answer: ChatAnswer) -> dict[str, Any]:
    calls = [
        {**call.to_openai(), "id": tool_call_id(answer.turn_id.hex, index)}
        for index, call in enumerate(answer.view.tool_calls)
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.view.content if (answer.view.content or not calls) else None,
    }
    if calls:
        message["tool_calls"] = calls
    return message


def usage_of(answer: ChatAnswer) -> dict[str, Any]:
    prompt = answer.result.prompt_tokens
    completion = len(answer.result.output_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": answer.result.cached_tokens},
    }


def logprobs_of(answer: ChatAnswer) -> dict[str, Any]:
    """Per generated token: its text, its engine log-prob and its bytes."""
    content = []
    for token, logprob in zip(answer.result.output_ids, answer.result.logprobs, strict=True):
        text = answer.template.tokenizer.decode([token])
        content.append(
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        )
    return {"content": content, "refusal": None}


def extension_of(answer: ChatAnswer) -> dict[str, Any]:
    return {"turn_id": str(answer.turn_id), "parent_turn_id": str(answer.parent_id)}


def completion_of(answer: ChatAnswer, *, with_logprobs: bool = False) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{answer.turn_id.hex}",
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message_of(answer),
                "logprobs": logprobs_of(answer) if with_logprobs else None,
                "finish_reason": answer.finish_reason,
            }
        ],
        "usage": usage_of(answer),
        "agentflow": extension_of(answer),
    }
