"""Env ids, registration by entry point, and resolving stored specs to runnable envs.

Ids look like Gymnasium's: ``namespace/Name-vN`` (``agentflow/guess-number-v0``).
``register(id, entry_point="pkg.mod:attr", kwargs=..., max_episode_steps=...)`` records a
factory; ``make(id, **kwargs)`` builds a fresh env. The built-in envs are registered when
this module is imported.

Importing a module runs its code, so entry points given as strings are imported only
from an allow-list of module prefixes: ``envs.`` by default, extended with
:func:`allow_modules` or the ``AGENTFLOW_ENV_MODULES`` environment variable
(comma-separated prefixes, e.g. ``mycompany.envs,lab_envs``). Anything else is refused
with :class:`EnvConfigError` before any import happens.

:func:`resolve` turns a spec as the REST API stores it (``envs.specs``) into an env:

- ``python``: the entry point, imported through the allow-list, called with ``kwargs``;
- ``http``: a :class:`envs.client.RemoteEnv` for the env server at ``url``;
- ``container``: an env server started from an image through a Docker client (the docker
  SDK's ``docker.DockerClient``); without ``docker_client=`` it raises
  :class:`EnvConfigError`, because there is no container runtime to start it with;
- ``browser``/``desktop``: the resolver registered for that kind with
  :func:`register_kind_resolver`, or :class:`EnvConfigError` when none is.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.base import Env, EnvConfigError, UnknownEnv
from envs.specs import ContainerEnvSpec, EnvSpec, HttpEnvSpec, PythonEnvSpec
from envs.wrappers import TimeLimit

ENV_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*-v\d+$")
MODULES_ENV_VAR = "AGENTFLOW_ENV_MODULES"
DEFAULT_MODULES: tuple[str, ...] = ("envs",)

EnvFactory = Callable[..., Env]
OraclePolicy = Callable[[Sequence[Any]], Any]


@dataclass(frozen=True)
class EnvEntry:
    """One registered env: how to build it and, if known, a policy that solves it."""

    id: str
    entry_point: str | EnvFactory
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_episode_steps: int | None = None
    oracle: str | OraclePolicy | None = None
    description: str = ""


_registry: dict[str, EnvEntry] = {}
_allowed: list[str] = list(DEFAULT_MODULES)
_kind_resolvers: dict[str, Callable[[Any], Env]] = {}
_shared_closers: list[Callable[[], Awaitable[None]]] = []
_BUILTIN_KIND_RESOLVERS = {
    "browser": "envs.browser.env:from_spec",
    "desktop": "envs.desktop.env:from_spec",
}


def validate_id(env_id: str) -> str:
    if not isinstance(env_id, str) or not ENV_ID.match(env_id):
        raise EnvConfigError(
            f"invalid env id {env_id!r}: expected 'namespace/Name-vN' "
            "(e.g. 'agentflow/guess-number-v0')"
        )
    return env_id


def allow_modules(*prefixes: str) -> None:
    """Allow entry points from modules under these prefixes (``"mypkg"`` allows ``mypkg.x``)."""
    for prefix in prefixes:
        prefix = prefix.strip().rstrip(".")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", prefix):
            raise EnvConfigError(f"invalid module prefix {prefix!r}")
        if prefix not in _allowed:
            _allowed.append(prefix)


def allowed_modules() -> list[str]:
    """The allow-list in force: the defaults, explicit additions and ``AGENTFLOW_ENV_MODULES``."""
    from_env = [p.strip().rstrip(".") for p in os.environ.get(MODULES_ENV_VAR, "").split(",")]
    return _allowed + [p for p in from_env if p and p not in _allowed]


def load_entry_point(entry_point: str) -> Any:
    """Import ``pkg.mod:attr`` if ``pkg.mod`` is on the allow-list; refuse otherwise."""
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise EnvConfigError(f"entry point {entry_point!r} must look like 'package.module:attr'")
    allowed = allowed_modules()
    if not any(module_name == p or module_name.startswith(p + ".") for p in allowed):
        raise EnvConfigError(
            f"entry point module {module_name!r} is not on the allow-list {allowed}; "
            f"add it with envs.registry.allow_modules() or {MODULES_ENV_VAR}"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvConfigError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EnvConfigError(f"{module_name!r} has no attribute {attr!r}") from None
    return target


def register(
    env_id: str,
    entry_point: str | EnvFactory,
    *,
    kwargs: dict[str, Any] | None = None,
    max_episode_steps: int | None = None,
    oracle: str | OraclePolicy | None = None,
    description: str = "",
    replace: bool = False,
) -> EnvEntry:
    """Record an env under ``env_id``; nothing is imported until :func:`make`."""
    validate_id(env_id)
    if env_id in _registry and not replace:
        raise EnvConfigError(f"env {env_id!r} is already registered")
    if max_episode_steps is not None and max_episode_steps < 1:
        raise EnvConfigError("max_episode_steps must be >= 1")
    entry = EnvEntry(
        env_id, entry_point, dict(kwargs or {}), max_episode_steps, oracle, description
    )
    _registry[env_id] = entry
    return entry


def unregister(env_id: str) -> None:
    _registry.pop(env_id, None)


def spec(env_id: str) -> EnvEntry:
    try:
        return _registry[env_id]
    except KeyError:
        raise UnknownEnv(f"no env registered as {env_id!r}") from None


def registered() -> list[str]:
    return sorted(_registry)


def make(env_id: str, **kwargs: Any) -> Env:
    """Build a fresh env registered as ``env_id``; ``kwargs`` override the registered ones."""
    entry = spec(env_id)
    factory = (
        load_entry_point(entry.entry_point)
        if isinstance(entry.entry_point, str)
        else entry.entry_point
    )
    env = factory(**{**entry.kwargs, **kwargs})
    if entry.max_episode_steps is not None:
        env = TimeLimit(env, entry.max_episode_steps)
    return env


def oracle(env_id: str) -> OraclePolicy:
    """The scripted policy that solves ``env_id``; :class:`UnknownEnv` if it has none."""
    entry = spec(env_id)
    if entry.oracle is None:
        raise UnknownEnv(f"env {env_id!r} has no oracle policy")
    policy = load_entry_point(entry.oracle) if isinstance(entry.oracle, str) else entry.oracle
    return policy


def noisy_oracle_factory(env_id: str) -> Callable[[float, int], OraclePolicy] | None:
    """The ``noisy_oracle(p_oracle, seed)`` beside ``env_id``'s registered oracle (a warm
    start's imperfect scripted player), or None when its module has none."""
    entry = spec(env_id)
    if not isinstance(entry.oracle, str):
        return None
    module = entry.oracle.partition(":")[0]
    try:
        factory: Callable[..., OraclePolicy] = load_entry_point(f"{module}:noisy_oracle")
    except EnvConfigError:
        return None
    if "oracle" in inspect.signature(factory).parameters:
        # One module's noisy player for many envs (a suite's tasks): told which oracle.
        solver = oracle(env_id)
        return lambda p_oracle, seed: factory(p_oracle, seed, oracle=solver)
    return factory


def on_close_shared(closer: Callable[[], Awaitable[None]]) -> None:
    """Run `closer` at :func:`close_shared`: for resources envs share across episodes
    within one event loop (the browser pool), which must end before their loop does."""
    if closer not in _shared_closers:
        _shared_closers.append(closer)


async def close_shared() -> None:
    """Close what envs share (see :func:`on_close_shared`); called when a run, a warm
    start or an evaluation ends its event loop, and at gateway shutdown."""
    closers, _shared_closers[:] = list(_shared_closers), []
    for closer in closers:
        await closer()


def register_kind_resolver(kind: str, resolver: Callable[[Any], Env]) -> None:
    """Let another module resolve specs of ``kind`` (``browser``, ``desktop``)."""
    _kind_resolvers[kind] = resolver


def resolve(env_spec: EnvSpec, *, docker_client: Any | None = None) -> Env:
    """Turn a validated spec (``envs.specs.parse_spec``) into a runnable env."""
    if isinstance(env_spec, PythonEnvSpec):
        factory = load_entry_point(env_spec.entry_point)
        if not callable(factory):
            raise EnvConfigError(f"{env_spec.entry_point!r} is not callable")
        return factory(**env_spec.kwargs)
    if isinstance(env_spec, HttpEnvSpec):
        from envs.client import RemoteEnv

        return RemoteEnv(
            str(env_spec.url),
            env=env_spec.env_id,
            headers=env_spec.headers,
            options=env_spec.options,
        )
    if isinstance(env_spec, ContainerEnvSpec):
        if docker_client is None:
            raise EnvConfigError(
                "container envs need a container runtime: pass docker_client= "
                "(a docker.DockerClient) to resolve(), or serve the image yourself and "
                "register it as an 'http' env"
            )
        from envs.container import ContainerEnv

        return ContainerEnv(env_spec, docker_client)
    resolver = _kind_resolvers.get(env_spec.kind)
    if resolver is None and env_spec.kind in _BUILTIN_KIND_RESOLVERS:
        # Imported on first use: the browser and desktop envs pull in Playwright.
        resolver = load_entry_point(_BUILTIN_KIND_RESOLVERS[env_spec.kind])
        _kind_resolvers[env_spec.kind] = resolver
    if resolver is None:
        raise EnvConfigError(f"no resolver is registered for env kind {env_spec.kind!r}")
    return resolver(env_spec)


def _register_builtins() -> None:
    builtins = (
        ("agentflow/guess-number-v0", "guess_number:GuessNumberEnv", "guess_number:oracle"),
        ("agentflow/calc-tool-v0", "calc_tool:CalcToolEnv", "calc_tool:oracle"),
        ("agentflow/lookup-v0", "lookup:LookupEnv", "lookup:oracle"),
        ("agentflow/shift-digits-v0", "digits:shift_digits", "digits:oracle"),
        ("agentflow/mirror-digits-v0", "digits:mirror_digits", "digits:oracle"),
        ("agentflow/digit-relay-v0", "digits:digit_relay", "digits:oracle"),
        ("agentflow/vault-v0", "vault:VaultEnv", "vault:oracle"),
    )
    for env_id, entry_point, oracle_path in builtins:
        register(
            env_id,
            f"envs.builtin.{entry_point}",
            oracle=f"envs.builtin.{oracle_path}",
            replace=True,
        )
    # Adapters to other suites: imported (with their suite) only when made.
    adapters = (
        ("gymnasium/FrozenLake-v1", "gym_text:frozen_lake"),
        ("gymnasium/Blackjack-v1", "gym_text:blackjack"),
        ("textarena/TicTacToe-v0", "textarena_games:tictactoe"),
        ("textarena/ConnectFour-v0", "textarena_games:connect_four"),
    )
    for env_id, entry_point in adapters:
        register(env_id, f"envs.adapters.{entry_point}", replace=True)
    # MiniWoB++ pages (listed from the miniwob wheel's folder; Playwright loads on reset).
    from envs.browser.miniwob import register_miniwob_tasks

    register_miniwob_tasks()
    # Desktop tasks (Xvfb + VNC + noVNC, driven through the noVNC page).
    from envs.desktop.tasks import register_desktop_tasks

    register_desktop_tasks()


BUILTIN_ENVS = (
    "agentflow/guess-number-v0",
    "agentflow/calc-tool-v0",
    "agentflow/lookup-v0",
    "agentflow/shift-digits-v0",
    "agentflow/mirror-digits-v0",
    "agentflow/digit-relay-v0",
    "agentflow/vault-v0",
)
_register_builtins()
