"""OpenAI chat-completion requests, validated, and the answers built from engine output.

Every field is honoured or refused with a 400 naming it, never silently dropped, where it
would change what is sampled. Accepted: text content (strings or `text` parts), images in
user messages as `image_url` parts holding base64 data URLs (PNG or JPEG; the gateway
never fetches a network URL), function tools with `tool_choice` `auto` or `none`, `n = 1`,
up to `MAX_STOP` stop strings (the answer ends where one first appears; the tokens that
made it are recorded, the text before it is returned), `logprobs` with up to 20
`top_logprobs`, `seed`. Refused: `tool_choice` `required` or a named function and a
`response_format` other than text (both need constrained decoding, which changes the
distribution the recorded log-probs must come from), non-zero `frequency_penalty` /
`presence_penalty`, a `logit_bias`. An image is rendered as the template's image
placeholder where it stood, and its bytes travel beside the tokens. Unknown top-level
fields that do not change the sampled tokens (`user`, `metadata`, `parallel_tool_calls`,
`store`, ...) are ignored, so unchanged agents work.

`temperature` and `top_p` are accepted but the run's sampling policy wins: the stored
log-probs must all come from one behaviour distribution for training to be correct.
`max_tokens` / `max_completion_tokens` may only shorten the run's `max_new_tokens`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from agentflow.errors import InvalidInput
from agentflow.images import parse_data_url
from agentflow.integers import Int64

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_STOP = 16


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=200)
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments are not JSON: {exc.msg}") from exc
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(default="", max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An image; `data` is set from the data URL by `parse_request`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["image_url"]
    image_url: ImageURL
    _data: bytes = PrivateAttr(default=b"")

    @property
    def data(self) -> bytes:
        return self._data


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=64)
    tool_call_id: str | None = None
    name: str | None = None

    def text(self, image_placeholder: str = "") -> str:
        """The content as text, each image as `image_placeholder` where it stood."""
        if isinstance(self.content, list):
            return "".join(
                part.text if isinstance(part, TextPart) else image_placeholder
                for part in self.content
            )
        return self.content or ""

    def images(self) -> list[bytes]:
        if not isinstance(self.content, list):
            return []
        return [part.data for part in self.content if isinstance(part, ImagePart)]

    def for_template(self, image_placeholder: str = "") -> dict[str, Any]:
        """The plain mapping the chat template renders (`developer` is a system message)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(image_placeholder),
        }
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    tools: list[ToolDef] | None = Field(default=None, max_length=256)
    tool_choice: Any = None
    response_format: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = Field(default=None, ge=1)
    max_completion_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: Int64 | None = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = Field(default=None, ge=0, le=20)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported: send one request per sample")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else list(value or ())
        if len(strings) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in strings):
            raise ValueError("a stop string must not be empty")
        if any(len(s) > 200 for s in strings):
            raise ValueError("a stop string has at most 200 characters")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value in (None, "auto", "none"):
            return value
        if value == "required" or isinstance(value, dict):
            raise ValueError(
                "only 'auto' and 'none' are supported: forcing a tool call needs "
                "constrained decoding, and the recorded log-probs must be the policy's own"
            )
        raise ValueError("must be 'auto', 'none', 'required' or a named function")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else value
        if value is None or kind == "text":
            return value
        raise ValueError(
            f"{kind!r} is not supported, only 'text': structured output needs constrained "
            "decoding, and the recorded log-probs must be the policy's own"
        )

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported: they change the sampled distribution")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported: it changes the sampled distribution")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop or ())

    def template_messages(self, image_placeholder: str = "") -> list[dict[str, Any]]:
        return [m.for_template(image_placeholder) for m in self.messages]

    def images(self) -> list[bytes]:
        """Every image of the conversation, in order (PNG or JPEG bytes)."""
        return [image for m in self.messages for image in m.images()]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def token_limit(self) -> int | None:
        limits = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return min(limits) if limits else None

    @property
    def parse_tool_calls(self) -> bool:
        return self.tool_choice != "none"


MAX_IMAGE_BYTES = 8 << 20


Body = TypeVar("Body", bound=BaseModel)


def validated(model: type[Body], body: Any) -> Body:
    """`body` (decoded JSON) as `model`; `InvalidInput` naming the first bad field, as
    OpenAI's `param` does."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object", field="body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidInput(f"{where}: {first['msg']}", field=where) from exc


def parse_request(body: Any, *, max_image_bytes: int = MAX_IMAGE_BYTES) -> ChatCompletionRequest:
    """Validate a decoded JSON body; `InvalidInput` naming the first bad field. Image
    parts are decoded here (data URLs only, PNG or JPEG, `max_image_bytes` each)."""
    request = validated(ChatCompletionRequest, body)
    if request.top_logprobs and not request.logprobs:
        raise InvalidInput("top_logprobs: needs logprobs = true", field="top_logprobs")
    if request.messages[-1].role == "assistant":
        raise InvalidInput(
            "the last message is an assistant message: continuing a prefilled assistant "
            "turn is not supported",
            field="messages",
        )
    _decode_images(request, max_image_bytes)
    return request


def _decode_images(request: ChatCompletionRequest, max_bytes: int) -> None:
    for i, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImagePart):
                continue
            where = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise InvalidInput(f"{where}: only user messages may carry images", field=where)
            url = part.image_url.url
            part._data = parse_data_url(url, max_bytes=max_bytes, field=f"{where}.image_url.url")


def error_body(
    message: str, *, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, which its clients turn into typed exceptions."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
