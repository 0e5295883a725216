"""The desktop env family: the `desktop` spec kind, and an env id per desktop task
(`desktop/<task>-v0`, each played by the tasks' one scripted player).

Registered through the `agentflow.envs` entry point (pyproject.toml); Playwright is
imported only when a desktop is viewed.
"""

from __future__ import annotations

from envs import registry
from envs.desktop.env import DesktopEnv, make_env
from envs.desktop.spec import DesktopEnvSpec
from envs.desktop.tasks import MAX_EPISODE_STEPS, TASKS, task_names


def from_spec(spec: DesktopEnvSpec) -> DesktopEnv:
    """The env a registered `desktop` spec describes."""
    return make_env(
        spec.task.removeprefix("desktop/").removesuffix("-v0"),
        novnc_url=None if spec.novnc_url is None else str(spec.novnc_url),
        state_url=None if spec.state_url is None else str(spec.state_url),
        screen=spec.screen,
        settle_ms=spec.settle_ms,
        wait_s=spec.wait_s,
    )


def register() -> list[str]:
    """Register the `desktop` kind and `desktop/<task>-v0` for every task (idempotent);
    the ids."""
    registry.register_kind("desktop", DesktopEnvSpec, from_spec, replace=True)
    ids = []
    for name in task_names():
        env_id = f"desktop/{name}-v0"
        registry.register(
            env_id,
            "envs.desktop.env:make_env",
            kwargs={"task": name},
            max_episode_steps=MAX_EPISODE_STEPS,
            oracle="envs.desktop.tasks:oracle",
            description=TASKS[name].instruction,
            replace=True,
        )
        ids.append(env_id)
    return ids
