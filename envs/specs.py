"""Env specs as the REST API stores them: one validated model per env kind.

`POST /v1/envs` carries `{kind, spec}`; `parse_spec(kind, spec)` turns the raw JSON into
the model of that kind or raises `pydantic.ValidationError` naming the bad field. The
registry (`envs.registry`) resolves a validated spec to a runnable env.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator

EnvKind = Literal["python", "http", "container", "browser", "desktop"]
ENV_KINDS: tuple[str, ...] = ("python", "http", "container", "browser", "desktop")

_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PythonEnvSpec(_Spec):
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


class HttpEnvSpec(_Spec):
    """An env served by an env server (`envs/server.py` protocol) at `url`."""

    kind: Literal["http"] = "http"
    url: AnyHttpUrl = Field(description="base URL of the env server")
    env_id: str | None = Field(
        default=None, description="env id on that server, if it serves several"
    )
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every request")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to reset")


class ContainerEnvSpec(_Spec):
    """An env server started in a container image; reached over HTTP on `port`."""

    kind: Literal["container"] = "container"
    image: str = Field(min_length=1, description="container image reference")
    command: list[str] = Field(min_length=1, description="argv that starts the env server")
    port: int = Field(default=8000, ge=1, le=65535, description="port the server listens on")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables")


class BrowserEnvSpec(_Spec):
    """A browser task driven through Playwright (BrowserGym-style actions)."""

    kind: Literal["browser"] = "browser"
    task: str = Field(min_length=1, description="task id, e.g. `miniwob.click-button`")
    start_url: AnyHttpUrl | None = Field(default=None, description="page to open first")
    viewport: tuple[int, int] = Field(default=(1280, 720), description="width, height")
    headless: bool = True


class DesktopEnvSpec(_Spec):
    """A desktop reached through a noVNC page (local Xvfb+VNC or a remote VM)."""

    kind: Literal["desktop"] = "desktop"
    task: str = Field(min_length=1, description="task id")
    novnc_url: AnyHttpUrl | None = Field(default=None, description="empty: start Xvfb locally")
    screen: tuple[int, int] = Field(default=(1280, 800), description="width, height")


EnvSpec = Annotated[
    PythonEnvSpec | HttpEnvSpec | ContainerEnvSpec | BrowserEnvSpec | DesktopEnvSpec,
    Field(discriminator="kind"),
]
_SPEC_BY_KIND: dict[str, type[_Spec]] = {
    "python": PythonEnvSpec,
    "http": HttpEnvSpec,
    "container": ContainerEnvSpec,
    "browser": BrowserEnvSpec,
    "desktop": DesktopEnvSpec,
}


def parse_spec(kind: str, spec: dict[str, Any]) -> EnvSpec:
    """Validate `spec` as the spec of `kind`; raises `pydantic.ValidationError`.

    Validated against the kind's own model (not the union) so error locations are the
    field path inside the spec, e.g. `("url",)`.
    """
    if kind not in _SPEC_BY_KIND:
        raise ValueError(f"unknown env kind {kind!r}; expected one of {ENV_KINDS}")
    model = _SPEC_BY_KIND[kind]
    return model.model_validate({**spec, "kind": kind})  # type: ignore[return-value]
