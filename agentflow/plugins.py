"""Plug-ins by dotted path: a run config names code as ``"package.module:function"``.

A run's agent (`agent.entry_point`), its reward functions (`[[envs]] reward`) and its
rollout hooks (`rollout.hooks`) are loaded with :func:`load_function` when the config is
parsed, so a bad path is refused naming its field before anything starts.

Importing a module runs its code, and run configs arrive over REST, so only modules under
an allow-list of prefixes are imported: ``agentflow`` by default, extended with the
``AGENTFLOW_PLUGIN_MODULES`` environment variable (comma-separated prefixes, e.g.
``mylab.rewards,agents``), read at each load. Anything else is refused before any import.

What a plug-in receives is one of the frozen records below (docs/runs.md, "Plug-ins").
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentflow.errors import InvalidInput

MODULES_ENV_VAR = "AGENTFLOW_PLUGIN_MODULES"
DEFAULT_MODULES: tuple[str, ...] = ("agentflow",)


def allowed_modules() -> list[str]:
    """The module prefixes plug-ins may come from: the defaults and ``AGENTFLOW_PLUGIN_MODULES``."""
    extra = [p.strip().rstrip(".") for p in os.environ.get(MODULES_ENV_VAR, "").split(",")]
    return [*DEFAULT_MODULES, *(p for p in extra if p and p not in DEFAULT_MODULES)]


def load_function(path: str, *, field: str | tuple[str, ...]) -> Callable[..., Any]:
    """Import ``package.module:attr`` from an allowed module; the callable it names.
    Raises `InvalidInput` naming `field` otherwise, before importing anything refused."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInput(f"{path!r} must look like 'package.module:function'", field=field)
    allowed = allowed_modules()
    if not any(module_name == p or module_name.startswith(p + ".") for p in allowed):
        raise InvalidInput(
            f"module {module_name!r} is not on the plug-in allow-list {allowed}; "
            f"add its package to {MODULES_ENV_VAR}",
            field=field,
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of the module's code is the config's
        raise InvalidInput(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}", field=field
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InvalidInput(f"{module_name!r} has no attribute {attr!r}", field=field)
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInput(f"{path!r} is {type(target).__name__}, not callable", field=field)
    return target


async def call(function: Callable[..., Any], argument: object) -> Any:
    """Call a sync or async plug-in. A sync one runs in a worker thread, so a slow one
    (a test suite, a judge model) does not stall the gateway's event loop."""
    if inspect.iscoroutinefunction(function):
        return await function(argument)
    result = await asyncio.to_thread(function, argument)
    if inspect.isawaitable(result):  # e.g. a callable object with an async __call__
        result = await result
    return result


@dataclass(frozen=True)
class RewardInput:
    """What a reward function (`[[envs]] reward`) sees of an episode that ended
    completed or truncated; its return value (a finite number) becomes the reward."""

    run_id: uuid.UUID
    episode_id: uuid.UUID
    env: str  # the env entry's id
    task: dict[str, Any]  # {seed, options, ...}
    status: str  # "completed" or "truncated"
    env_reward: float | None  # the reward the env (or black-box agent) gave
    texts: tuple[str, ...]  # per trajectory leaf, its whole context decoded (tree order)

    @property
    def text(self) -> str:
        """The episode's final text: the last leaf's context, the only one of a linear
        episode ("" when the episode recorded no turn)."""
        return self.texts[-1] if self.texts else ""


@dataclass(frozen=True)
class EpisodeEvent:
    """What a rollout hook (`rollout.hooks`) sees once an episode is recorded."""

    run_id: uuid.UUID
    episode_id: uuid.UUID
    env: str  # the env entry's id
    status: str  # completed, truncated, failed or aborted
    reward: float | None  # as stored: a reward function's value where one is set
    error: str | None
    trajectories: int  # trajectories the episode made
