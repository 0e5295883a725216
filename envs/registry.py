"""Env ids and spec kinds, filled in by the env families; nothing here knows a family.

Ids look like Gymnasium's: ``namespace/Name-vN`` (``agentflow/guess-number-v0``).
``register(id, entry_point="pkg.mod:attr", kwargs=..., max_episode_steps=...)`` records a
factory; ``make(id, **kwargs)`` builds a fresh env.

Env families register themselves: each is a ``register()`` function named by an entry
point of the ``agentflow.envs`` group (this project's are listed in pyproject.toml: the
built-in text envs, the adapters, ``http``, ``container``, the browser and the desktop
families; an installed package adds its own the same way). They are loaded once per
process, on the first use of this registry, so ``registry.make("miniwob/...")`` works
after ``from envs import registry`` alone. A family that fails to load is logged and
named by the error of any id it would have brought; the others still load.

Importing a module runs its code, so entry points given as strings are imported only
from an allow-list of module prefixes: ``envs.`` by default, extended with
:func:`allow_modules` or the ``AGENTFLOW_ENV_MODULES`` environment variable
(comma-separated prefixes, e.g. ``mycompany.envs,lab_envs``). Anything else is refused
with :class:`EnvConfigError` before any import happens. (The families' entry points are
the installed packages' own metadata, trusted as their code is.)

A spec as the REST API stores it, ``{kind, spec}``, is validated by :func:`parse_spec`
against its kind's model and turned into an env by :func:`resolve`. The ``python`` kind
is the registry's own (a factory by dotted path, through the allow-list); every other
kind is registered by its family with :func:`register_kind`: ``http``
(:class:`envs.client.RemoteEnv`), ``container`` (needs ``docker_client=``), ``browser``
and ``desktop``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from envs.base import Env, EnvConfigError, UnknownEnv
from envs.specs import EnvSpecModel, PythonEnvSpec
from envs.wrappers import TimeLimit

logger = logging.getLogger(__name__)

FAMILIES_GROUP = "agentflow.envs"

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


@dataclass(frozen=True)
class KindEntry:
    """One kind of stored spec: its model, and how a validated spec becomes an env
    (``resolver(spec)``; ``resolver(spec, docker_client=...)`` when the caller has one)."""

    kind: str
    spec: type[EnvSpecModel]
    resolver: Callable[..., Env]


_registry: dict[str, EnvEntry] = {}
_kinds: dict[str, KindEntry] = {}
_allowed: list[str] = list(DEFAULT_MODULES)
_shared_closers: list[Callable[[], Awaitable[None]]] = []
_families_lock = threading.RLock()
_families_loaded = False
_families_loading = False  # re-entered from a family's own register() calls
_family_errors: dict[str, str] = {}


def load_families() -> None:
    """Load every env family named by an ``agentflow.envs`` entry point, once per
    process; the registry's other functions call this first."""
    global _families_loaded, _families_loading
    if _families_loaded:
        return
    with _families_lock:
        if _families_loaded or _families_loading:
            return
        _families_loading = True
        try:
            seen = set()
            for point in sorted(entry_points(group=FAMILIES_GROUP), key=lambda p: p.name):
                if point.name in seen:  # the same distribution found twice on the path
                    continue
                seen.add(point.name)
                try:
                    point.load()()
                except Exception as exc:  # one broken family must not hide the others
                    _family_errors[point.name] = f"{type(exc).__name__}: {exc}"
                    logger.warning("env family %r failed to load: %s", point.name, exc)
            if not seen:
                _family_errors[""] = (
                    f"no env families are installed (no {FAMILIES_GROUP!r} entry points: "
                    "install the package, e.g. pip install -e .)"
                )
        finally:
            _families_loaded, _families_loading = True, False


def _families_note() -> str:
    """What an unknown id or kind may be missing for: families that failed to load."""
    if not _family_errors:
        return ""
    failed = "; ".join(
        message if not name else f"env family {name!r} failed to load: {message}"
        for name, message in sorted(_family_errors.items())
    )
    return f" ({failed})"


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
    load_families()  # first, so a family never replaces what its caller registers
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
    load_families()
    _registry.pop(env_id, None)


def spec(env_id: str) -> EnvEntry:
    load_families()
    try:
        return _registry[env_id]
    except KeyError:
        raise UnknownEnv(f"no env registered as {env_id!r}{_families_note()}") from None


def registered() -> list[str]:
    load_families()
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


def register_kind(
    kind: str,
    spec_model: type[EnvSpecModel],
    resolver: Callable[..., Env],
    *,
    replace: bool = False,
) -> KindEntry:
    """Let a family's specs of ``kind`` be stored (validated by ``spec_model``) and run
    (``resolver``)."""
    load_families()
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,15}", kind):
        raise EnvConfigError(f"invalid env kind {kind!r}: 1-16 of a-z, 0-9, '_' and '-'")
    if kind in _kinds and not replace:
        raise EnvConfigError(f"env kind {kind!r} is already registered")
    entry = KindEntry(kind, spec_model, resolver)
    _kinds[kind] = entry
    return entry


def kinds() -> list[str]:
    """The registered kinds of stored spec, sorted."""
    load_families()
    return sorted(_kinds)


def kind(name: str) -> KindEntry:
    load_families()
    try:
        return _kinds[name]
    except KeyError:
        raise ValueError(
            f"unknown env kind {name!r}; expected one of {tuple(sorted(_kinds))}{_families_note()}"
        ) from None


def parse_spec(kind_name: str, spec: dict[str, Any]) -> EnvSpecModel:
    """Validate `spec` as the spec of `kind_name`: the kind's model, or
    `pydantic.ValidationError` naming the bad field by its path inside the spec (e.g.
    `("url",)`); `ValueError` for an unknown kind."""
    model = kind(kind_name).spec
    return model.model_validate({**spec, "kind": kind_name})


def resolve(env_spec: EnvSpecModel, *, docker_client: Any | None = None) -> Env:
    """Turn a validated spec (:func:`parse_spec`) into a runnable env, by its kind's
    resolver; ``docker_client`` (a ``docker.DockerClient``) is handed to it when given."""
    options = {} if docker_client is None else {"docker_client": docker_client}
    return kind(env_spec.kind).resolver(env_spec, **options)


def _make_python(env_spec: PythonEnvSpec) -> Env:
    factory = load_entry_point(env_spec.entry_point)
    if not callable(factory):
        raise EnvConfigError(f"{env_spec.entry_point!r} is not callable")
    env: Env = factory(**env_spec.kwargs)
    return env


_kinds["python"] = KindEntry("python", PythonEnvSpec, _make_python)
