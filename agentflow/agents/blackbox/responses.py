"""OpenAI `chat.completion` objects built from a `ChatAnswer`.

Besides OpenAI's fields the answer carries `agentflow` (the policy turn and the turn it
continues), which OpenAI clients ignore and tools that inspect the turn tree can use.
"""

from __future__ import annotations

from typing import Any

from agentflow.agents.blackbox.matching import tool_call_id
from agentflow.agents.blackbox.proxy import ChatAnswer
from agentflow.tokenization.chat import ChatTemplate


def message_of(answer: ChatAnswer) -> dict[str, Any]:
    style = getattr(answer.template, "tool_call_style", None)
    calls = [
        {**call.to_openai(), "id": tool_call_id(answer.turn_id.hex, index, style)}
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


def token_entry(template: ChatTemplate, token: int, logprob: float) -> dict[str, Any]:
    """One token in OpenAI's `logprobs.content` shape, without its top log-probs."""
    text = template.tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


def token_entries(answer: ChatAnswer) -> list[dict[str, Any]]:
    """Per generated token: its text, its engine log-prob, its bytes, and the most likely
    tokens at that step when `top_logprobs` asked for them."""
    result = answer.result
    tops = result.top_logprobs or [[] for _ in result.output_ids]
    template = answer.template
    entries = []
    for token, logprob, top in zip(result.output_ids, result.logprobs, tops, strict=True):
        entry = token_entry(template, token, logprob)
        entry["top_logprobs"] = [
            {k: v for k, v in token_entry(template, t, lp).items() if k != "top_logprobs"}
            for t, lp in top
        ]
        entries.append(entry)
    return entries


def logprobs_of(answer: ChatAnswer) -> dict[str, Any]:
    return {"content": token_entries(answer), "refusal": None}


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
