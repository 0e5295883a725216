"""The Env protocol, its action/observation types and its exception tree.

An env is async and Gymnasium-shaped: ``reset`` starts an episode, ``step`` applies one
action, both answer a :class:`StepResult`. ``observation.messages`` holds only the *new*
messages of that step (the agent appends them to its conversation).

Actions are a tagged union on ``type``::

    {"type": "text", "text": "8"}
    {"type": "tool_calls", "calls": [{"id": "c1", "name": "lookup", "arguments": {...}}]}
    {"type": "browser", "call": "click('12')"}
    {"type": "computer", "action_type": "CLICK", "parameters": {"x": 3, "y": 4}}

Exceptions (each carries the HTTP status the env server answers with)::

    EnvError                   500  the env failed (a bug or crash inside it)
     ├── UnknownEnv            404  no env registered under that id / no such session
     ├── EnvConfigError        422  an id, entry point or spec that cannot be used
     ├── InvalidAction         422  an action the env cannot accept at all
     ├── EpisodeFinished       409  step after the episode terminated or was truncated
     ├── EnvClosed             409  any call after close()
     ├── EnvCapacity           503  the server holds as many sessions as it may; retry later
     └── StepTimeout           504  the step did not finish within its timeout

A model's *mistakes* (an unparseable answer, an unknown tool name, bad tool arguments)
are not exceptions: the env answers them with a feedback observation, because a policy
being trained must see the consequence of its output.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_serializer,
    field_validator,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class EnvError(Exception):
    """Base of every error an env or the env server raises on purpose."""

    status_code: int = 500
    code: str = "ENV_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownEnv(EnvError):
    status_code = 404
    code = "NOT_FOUND"


class EnvConfigError(EnvError):
    status_code = 422
    code = "CONFIG_ERROR"


class InvalidAction(EnvError):
    status_code = 422
    code = "INVALID_ACTION"


class EpisodeFinished(EnvError):
    status_code = 409
    code = "EPISODE_FINISHED"


class EnvClosed(EnvError):
    status_code = 409
    code = "ENV_CLOSED"


class EnvCapacity(EnvError):
    status_code = 503
    code = "CAPACITY_REACHED"


class StepTimeout(EnvError):
    status_code = 504
    code = "STEP_TIMEOUT"


ERRORS_BY_CODE: dict[str, type[EnvError]] = {
    cls.code: cls
    for cls in (
        EnvError,
        UnknownEnv,
        EnvConfigError,
        InvalidAction,
        EpisodeFinished,
        EnvClosed,
        EnvCapacity,
        StepTimeout,
    )
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Model):
    """One chat message; ``tool_call_id``/``name`` are set on ``role="tool"`` replies."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_call_id: str | None = None
    name: str | None = None


class Observation(_Model):
    """What the agent sees after reset or a step."""

    messages: list[Message] = Field(default_factory=list, description="new messages only")
    text: str | None = Field(default=None, description="plain-text rendering, if any")
    axtree: str | None = Field(default=None, description="accessibility tree as text")
    url: str | None = None
    image: bytes | None = Field(default=None, description="PNG bytes; base64 in JSON")

    @field_validator("image", mode="before")
    @classmethod
    def _png(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = base64.b64decode(value, validate=True)
            except binascii.Error as exc:
                raise ValueError("image must be PNG bytes or their base64 text") from exc
        if not isinstance(value, bytes | bytearray) or not bytes(value).startswith(PNG_SIGNATURE):
            raise ValueError("image must be a PNG (bytes or base64 text)")
        return bytes(value)

    @field_serializer("image", when_used="json-unless-none")
    def _png_b64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")


class StepResult(_Model):
    observation: Observation
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class TextAction(_Model):
    type: Literal["text"] = "text"
    text: str = Field(max_length=100_000)


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallsAction(_Model):
    type: Literal["tool_calls"] = "tool_calls"
    calls: list[ToolCall] = Field(min_length=1, max_length=64)


class BrowserAction(_Model):
    """A BrowserGym-style call string; parsed through an allow-list, never executed."""

    type: Literal["browser"] = "browser"
    call: str = Field(min_length=1, max_length=10_000)


ComputerActionType = Literal[
    "MOVE_TO",
    "CLICK",
    "MOUSE_DOWN",
    "MOUSE_UP",
    "RIGHT_CLICK",
    "DOUBLE_CLICK",
    "DRAG_TO",
    "SCROLL",
    "TYPING",
    "PRESS",
    "KEY_DOWN",
    "KEY_UP",
    "HOTKEY",
    "WAIT",
    "FAIL",
    "DONE",
]


class ComputerAction(_Model):
    """An OSWorld ``computer_13`` action."""

    type: Literal["computer"] = "computer"
    action_type: ComputerActionType
    parameters: dict[str, Any] = Field(default_factory=dict)


Action = Annotated[
    TextAction | ToolCallsAction | BrowserAction | ComputerAction, Field(discriminator="type")
]
ACTION_ADAPTER: TypeAdapter[Action] = TypeAdapter(Action)


def parse_action(raw: Any) -> Action:
    """Validate a raw action (dict or model); raises :class:`InvalidAction` naming the field."""
    if isinstance(raw, TextAction | ToolCallsAction | BrowserAction | ComputerAction):
        return raw
    from pydantic import ValidationError

    try:
        return ACTION_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "action"
        raise InvalidAction(f"malformed action: {where}: {first['msg']}") from exc


def tool_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function-tool schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


@runtime_checkable
class Env(Protocol):
    """An environment an agent acts on, in process or over the network."""

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        """Start a new episode (ending any current one)."""
        ...

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        """Apply one action; raises :class:`StepTimeout` past ``timeout_s``."""
        ...

    async def state(self) -> dict[str, Any]:
        """A JSON-able summary of the episode so far (for debugging and the API)."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function-tool schemas of the tools this env offers (may be empty)."""
        ...

    async def close(self) -> None:
        """Release everything the env holds; safe to call twice."""
        ...
