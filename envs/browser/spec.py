"""The `browser` kind's spec, as the REST API stores it: a MiniWoB++ task id, checked
against the pages the miniwob package ships."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from envs.browser.miniwob import task_names
from envs.specs import EnvSpecModel

_Pixels = Annotated[int, Field(ge=100, le=4096)]


class BrowserEnvSpec(EnvSpecModel):
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
        if value.removeprefix("miniwob/").removesuffix("-v0") not in task_names():
            raise ValueError(f"no MiniWoB++ task {value!r} (is the miniwob package installed?)")
        return value
