"""Env specs as the REST API stores them: one validated model per env kind.

`POST /v1/envs` carries `{kind, spec}`; `envs.registry.parse_spec(kind, spec)` turns the
raw JSON into the model of that kind or raises `pydantic.ValidationError` naming the bad
field, and `envs.registry.resolve` turns a validated spec into a runnable env. Each kind
is registered by the env family that runs it (`envs.registry.register_kind`): `python`
by the registry itself; `http`, `container`, `browser` and `desktop` by their families.

Here: the base of every spec model, and the models that need no family's code to be
validated (`python`, `http`, `container`). The browser and desktop families validate task
ids against their own task lists, so their models live with them (envs/browser/spec.py,
envs/desktop/spec.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator

_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class EnvSpecModel(BaseModel):
    """The base of every kind's spec: unknown fields are refused, values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str


class PythonEnvSpec(EnvSpecModel):
    """An env class or factory imported in process, by dotted path."""

    kind: Literal["python"] = "python"
    entry_point: str = Field(description="`package.module:attr`, importable from the allow-list")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to the factory")

    @field_validator("entry_point")
    @classmethod
    def _dotted(cls, value: str) -> str:
        if not _ENTRY_POINT.match(value):
            raise ValueError("must look like 'package.module:attr'")
        return value


class HttpEnvSpec(EnvSpecModel):
    """An env served by an env server (`envs/server.py` protocol) at `url`."""

    kind: Literal["http"] = "http"
    url: AnyHttpUrl = Field(description="base URL of the env server")
    env_id: str | None = Field(
        default=None, description="env id on that server, if it serves several"
    )
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every request")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to reset")


class ContainerEnvSpec(EnvSpecModel):
    """An env server started in a container image; reached over HTTP on `port`."""

    kind: Literal["container"] = "container"
    image: str = Field(min_length=1, description="container image reference")
    command: list[str] = Field(min_length=1, description="argv that starts the env server")
    port: int = Field(default=8000, ge=1, le=65535, description="port the server listens on")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables")
