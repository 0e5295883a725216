"""OpenAI's Responses API (`POST /v1/responses`), the subset agents use, on the chat core.

A request is turned into a chat-completion request and answered by the same `ChatProxy`,
so recording, matching and branching are exactly those of `/chat/completions`:

- `input` (a string, or items: messages with `input_text` / `output_text` /
  `input_image` parts, `function_call`, `function_call_output`) and `instructions` (a
  system message first) become the conversation; an assistant message and the function
  calls after it are one assistant turn, as the answer that made them was one;
- `tools` (function tools, flat as the Responses API writes them), `tool_choice`,
  `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` and the log-probs include
  (`message.output_text.logprobs`) map to their chat fields, with the same rules;
- `text.format` other than text, `reasoning`, server-side state (`previous_response_id`,
  `conversation`, stored `prompt`s), `stream: true` and input items other than the above
  are refused with a 400 naming the field. `store`, `metadata`, `user`, `truncation`,
  `parallel_tool_calls` and the prompt-cache hints change no token and are ignored.

The answer is a `response` object whose output is a `message` item (when there is text)
and one `function_call` item per tool call, with the call ids the chat API would give.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentflow.agents.blackbox.matching import tool_call_id
from agentflow.agents.blackbox.openai_schema import (
    ChatCompletionRequest,
    parse_request,
    validated,
)
from agentflow.agents.blackbox.proxy import ChatAnswer
from agentflow.agents.blackbox.responses import extension_of, token_entries
from agentflow.errors import InvalidInput
from agentflow.integers import Int64

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _function(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"{value!r} tools are not supported, only function tools")
        return value


def _refuse_set(value: Any, why: str) -> Any:
    if value is not None:
        raise ValueError(why)
    return value


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=256)
    tool_choice: Any = None
    max_output_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: Int64 | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "streaming is not supported on /v1/responses; use stream=false, or "
                "/v1/chat/completions, which streams"
            )
        return value

    @field_validator("text")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (value or {}).get("format")
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if kind not in (None, "text"):
            raise ValueError(
                f"format {kind!r} is not supported, only 'text': structured output needs "
                "constrained decoding, and the recorded log-probs must be the policy's own"
            )
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and any(v is not None for v in value.values()):
            raise ValueError("reasoning settings are not supported: the run's template decides")
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _no_server_state(cls, value: Any) -> Any:
        return _refuse_set(
            value, "server-side conversation state is not kept: send the whole input"
        )

    @property
    def with_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


def _text_of(content: Any, where: str) -> tuple[str | list[dict[str, Any]], bool]:
    """A message's content in chat form; whether it holds an image."""
    if isinstance(content, str):
        return content, False
    if not isinstance(content, list):
        raise InvalidInput(f"{where}: must be a string or a list of parts", field=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            field = f"{where}.{j}.type"
            raise InvalidInput(f"{field}: content part {kind!r} is not supported", field=field)
    if any(p["type"] == "image_url" for p in parts):
        return parts, True
    return "".join(p["text"] for p in parts), False


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation `request` holds, as chat-completion messages (module docstring)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    open_assistant: dict[str, Any] | None = None  # the turn function calls attach to
    for i, item in enumerate(request.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidInput(f"{where}.role: {role!r} is not a message role", field=where)
            content, _ = _text_of(item.get("content"), f"{where}.content")
            message = {"role": role, "content": content}
            messages.append(message)
            open_assistant = message if role == "assistant" else None
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": None}
                messages.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output, _ = _text_of(item.get("output", ""), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output}
            )
            open_assistant = None
        else:
            field = f"{where}.type"
            raise InvalidInput(f"{field}: input item {kind!r} is not supported", field=field)
    return messages


def parse_responses_request(
    body: Any, *, max_image_bytes: int
) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """Validate a `/v1/responses` body and turn it into the chat request it stands for."""
    request = validated(ResponsesRequest, body)
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "tool_choice": request.tool_choice,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "logprobs": request.with_logprobs,
        "top_logprobs": request.top_logprobs,
    }
    if request.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in request.tools
        ]
    return request, parse_request(chat, max_image_bytes=max_image_bytes)


def response_of(answer: ChatAnswer, request: ResponsesRequest) -> dict[str, Any]:
    """The `response` object for `answer`."""
    turn = answer.turn_id.hex
    output: list[dict[str, Any]] = []
    content = answer.view.content
    if content or not answer.view.tool_calls:
        text: dict[str, Any] = {"type": "output_text", "text": content, "annotations": []}
        if request.with_logprobs:
            text["logprobs"] = token_entries(answer)
        output.append(
            {
                "type": "message",
                "id": f"msg_{turn}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for index, call in enumerate(answer.view.tool_calls):
        wire = call.to_openai()["function"]
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{turn[:24]}_{index}",
                "call_id": tool_call_id(
                    turn, index, getattr(answer.template, "tool_call_style", None)
                ),
                "name": wire["name"],
                "arguments": wire["arguments"],
                "status": "completed",
            }
        )
    cut = answer.finish_reason == "length"
    prompt = answer.result.prompt_tokens
    produced = len(answer.result.output_ids)
    return {
        "id": f"resp_{turn}",
        "object": "response",
        "created_at": answer.created,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": answer.model,
        "output": output,
        "instructions": request.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()],
        "tool_choice": request.tool_choice or "auto",
        "parallel_tool_calls": True,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": None,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": answer.result.cached_tokens},
            "output_tokens": produced,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + produced,
        },
        "agentflow": extension_of(answer),
    }
