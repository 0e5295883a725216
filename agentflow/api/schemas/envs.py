"""Environment registry schemas: `EnvCreate` / `EnvUpdate` / `EnvPublic`."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from agentflow.integers import Int32
from envs import registry

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"


def _registered_kind(value: str) -> str:
    registry.kind(value)  # ValueError naming the kinds there are
    return value


EnvKind = Annotated[
    str,
    Field(
        max_length=16,
        description="a kind an env family registered (envs.registry.kinds()): python, "
        "http, container, browser, desktop, and any an installed family adds",
    ),
    AfterValidator(_registered_kind),
]


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
    description: str = ""
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the arguments",
    )


class Tool(BaseModel):
    """An OpenAI-style function tool schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: ToolFunction


class EnvCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="letters, digits, `._/-`")
    version: str = Field(default="1", pattern=VERSION_PATTERN)
    kind: EnvKind
    spec: dict[str, Any] = Field(
        description="validated by the kind's model (envs/specs.py and the families')"
    )
    tools: list[Tool] = Field(default_factory=list, max_length=256)
    max_concurrency: Int32 = Field(default=64, ge=1, le=100_000)
    step_timeout_s: float = Field(default=60.0, gt=0, le=86_400)
    description: str = Field(default="", max_length=10_000)


class EnvUpdate(BaseModel):
    """Fields that may change; name, version and kind identify the env and do not."""

    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=256)
    max_concurrency: Int32 | None = Field(default=None, ge=1, le=100_000)
    step_timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    description: str | None = Field(default=None, max_length=10_000)


class EnvPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    version: str
    kind: str
    spec: dict[str, Any]
    tools: list[dict[str, Any]]
    max_concurrency: int
    step_timeout_s: float
    description: str
    created_at: datetime
    updated_at: datetime
