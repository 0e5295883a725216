"""The `desktop` kind's spec, as the REST API stores it: a desktop task id, checked
against the tasks of envs/desktop/tasks.py, on a local desktop or a remote VM's."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import AnyHttpUrl, Field, field_validator, model_validator

from envs.desktop.tasks import TASKS, task_names
from envs.specs import EnvSpecModel


class DesktopEnvSpec(EnvSpecModel):
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
            name = self.task.removeprefix("desktop/").removesuffix("-v0")
            if TASKS[name].feasible:
                raise ValueError(
                    f"task {self.task!r} is checked by reading the desktop's state: "
                    "a remote desktop needs state_url for it"
                )
        return self
