"""Env specs as the REST API stores them: one validated model per env kind.

`POST /v1/envs` carries `{kind, spec}`; `parse_spec(kind, spec)` turns the raw JSON into
the model of that kind or raises `pydantic.ValidationError` naming the bad field. The
registry (`envs.registry`) resolves a validated spec to a runnable env.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator, model_validator

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


_Pixels = Annotated[int, Field(ge=100, le=4096)]


class BrowserEnvSpec(_Spec):
    """A browser task driven through Playwright with BrowserGym's actions
    (envs/browser/): a MiniWoB++ task id such as `miniwob/click-button-v0`.

    Where the page may go is the task's, not the spec's: `goto` reaches only the task's
    own origin and every other request is aborted. How many browsers serve the episodes
    is the process's (`AGENTFLOW_BROWSER_POOL_SIZE`), not one env's."""

    kind: Literal["browser"] = "browser"
    task: str = Field(
        min_length=1,
        max_length=200,
        description="task id: `miniwob/<task>-v0` (every page the miniwob package ships)",
    )
    screenshots: bool = Field(default=True, description="a PNG screenshot in each observation")
    compact_chars: int = Field(
        default=600, ge=100, le=100_000, description="length cap of the compact page text"
    )
    action_timeout_ms: int = Field(
        default=2_000, ge=100, le=60_000, description="how long an action waits for its element"
    )
    viewport: tuple[_Pixels, _Pixels] | None = Field(
        default=None, description="width, height in pixels; empty: the task's own (500x340)"
    )
    recycle_pages: bool = Field(
        default=True,
        description="run the next episode in the last one's page, put back as loaded (as "
        "MiniWoB++ does); false: a new browser context for every episode",
    )

    @field_validator("task")
    @classmethod
    def _task_id(cls, value: str) -> str:
        if not re.fullmatch(r"miniwob/[a-z0-9-]+-v0", value):
            raise ValueError("must be a MiniWoB++ task id such as 'miniwob/click-button-v0'")
        from envs.browser.miniwob import task_names

        if value.removeprefix("miniwob/").removesuffix("-v0") not in task_names():
            raise ValueError(f"no MiniWoB++ task {value!r} (is the miniwob package installed?)")
        return value


class DesktopEnvSpec(_Spec):
    """A desktop task (envs/desktop/) played through a noVNC page with OSWorld's
    `computer_13` actions: on a local Xvfb desktop started per episode, or on a remote
    VM's desktop at `novnc_url`.

    A remote desktop is only viewed and driven; tasks whose checker reads state (files,
    windows) need the VM's OSWorld-style state server at `state_url`; without it only
    tasks judged by the episode's last action (the infeasible ones) can run there.
    """

    kind: Literal["desktop"] = "desktop"
    task: str = Field(
        min_length=1,
        max_length=200,
        description="task id: `desktop/<task>-v0` (envs/desktop/tasks.py)",
    )
    novnc_url: AnyHttpUrl | None = Field(
        default=None,
        description="a remote desktop's noVNC page, e.g. `http://vm:6080/vnc.html?autoconnect=1"
        "&resize=off`; empty: a local Xvfb desktop",
    )
    state_url: AnyHttpUrl | None = Field(
        default=None,
        description="the remote desktop's state server (OSWorld's `/execute`, `/file`, "
        "`/setup/upload`, `/setup/launch`); only with `novnc_url`",
    )
    screen: tuple[int, int] = Field(
        default=(1280, 800),
        description="width, height of a local desktop (a remote's is read from its page)",
    )
    settle_ms: int = Field(
        default=200,
        ge=0,
        le=5_000,
        description="how long the screen must stay still before an observation",
    )
    wait_s: float = Field(default=1.0, ge=0, le=30, description="how long a WAIT action waits")

    @field_validator("task")
    @classmethod
    def _task_id(cls, value: str) -> str:
        if not re.fullmatch(r"desktop/[a-z0-9-]+-v0", value):
            raise ValueError("must be a desktop task id such as 'desktop/terminal-echo-v0'")
        from envs.desktop.tasks import task_names

        if value.removeprefix("desktop/").removesuffix("-v0") not in task_names():
            raise ValueError(f"no desktop task {value!r}; expected one of {task_names()}")
        return value

    @field_validator("screen")
    @classmethod
    def _screen(cls, value: tuple[int, int]) -> tuple[int, int]:
        width, height = value
        if not (320 <= width <= 3840 and 240 <= height <= 2160):
            raise ValueError("screen must be between 320x240 and 3840x2160")
        return value

    @model_validator(mode="after")
    def _remote(self) -> DesktopEnvSpec:
        if self.state_url is not None and self.novnc_url is None:
            raise ValueError("state_url is the state server of a remote desktop: set novnc_url")
        if self.novnc_url is not None and self.state_url is None:
            from envs.desktop.tasks import TASKS

            name = self.task.removeprefix("desktop/").removesuffix("-v0")
            if TASKS[name].feasible:
                raise ValueError(
                    f"task {self.task!r} is checked by reading the desktop's state: "
                    "a remote desktop needs state_url for it"
                )
        return self


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
