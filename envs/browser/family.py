"""The browser env family: the `browser` spec kind, and an env id per MiniWoB++ task
(`miniwob/<task>-v0`, with its scripted player where it has one).

Registered through the `agentflow.envs` entry point (pyproject.toml); Playwright is
imported only when a page is driven.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envs import registry
from envs.browser.miniwob import MAX_EPISODE_STEPS, make_env, task_names
from envs.browser.oracles import ORACLES
from envs.browser.spec import BrowserEnvSpec

if TYPE_CHECKING:
    from envs.browser.env import BrowserEnv


def from_spec(spec: BrowserEnvSpec) -> BrowserEnv:
    """The env a registered `browser` spec describes (on the shared pool)."""
    return make_env(
        spec.task.removeprefix("miniwob/").removesuffix("-v0"),
        screenshots=spec.screenshots,
        compact_chars=spec.compact_chars,
        recycle_pages=spec.recycle_pages,
        action_timeout_ms=spec.action_timeout_ms,
        viewport=spec.viewport,
    )


def register() -> None:
    """Register the `browser` kind and every shipped task, with its oracle if it has one."""
    registry.register_kind("browser", BrowserEnvSpec, from_spec, replace=True)
    for name in task_names():
        oracle = ORACLES.get(name)
        registry.register(
            f"miniwob/{name}-v0",
            "envs.browser.miniwob:make_env",
            kwargs={"task": name},
            max_episode_steps=MAX_EPISODE_STEPS,
            oracle=f"envs.browser.oracles:{oracle.__name__}" if oracle else None,
            description=f"MiniWoB++ {name}",
            replace=True,
        )
