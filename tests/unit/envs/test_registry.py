import sys

import pytest

from envs import registry
from envs.base import EnvConfigError, EpisodeFinished, TextAction, UnknownEnv
from envs.builtin.guess_number import GuessNumberEnv
from envs.client import RemoteEnv
from envs.registry import parse_spec


@pytest.mark.parametrize("env_id", ["agentflow/guess-number-v0", "lab/Maze_2-v12", "a.b/x-v0"])
def test_valid_ids(env_id: str) -> None:
    assert registry.validate_id(env_id) == env_id


@pytest.mark.parametrize("env_id", ["guess-v0", "agentflow/guess", "A/b-v1", "a/b-v", "a//b-v0"])
def test_invalid_ids(env_id: str) -> None:
    with pytest.raises(EnvConfigError, match="namespace/Name-vN"):
        registry.validate_id(env_id)


def test_builtins_are_registered_with_oracles() -> None:
    for env_id in ("agentflow/guess-number-v0", "agentflow/calc-tool-v0", "agentflow/lookup-v0"):
        assert env_id in registry.registered()
        assert callable(registry.oracle(env_id))


def test_make_passes_kwargs_and_unknown_id_is_404() -> None:
    env = registry.make("agentflow/guess-number-v0", high=8)
    assert isinstance(env, GuessNumberEnv) and env.high == 8
    with pytest.raises(UnknownEnv) as info:
        registry.make("agentflow/nope-v0")
    assert info.value.status_code == 404


def test_entry_points_outside_the_allow_list_are_refused_before_import() -> None:
    assert "antigravity" not in sys.modules
    registry.register("test/evil-v0", "antigravity:fly", replace=True)
    try:
        with pytest.raises(EnvConfigError, match="not on the allow-list"):
            registry.make("test/evil-v0")
        assert "antigravity" not in sys.modules  # refused without running its code
        with pytest.raises(EnvConfigError, match="allow-list"):
            registry.load_entry_point("envsevil.mod:X")  # a prefix must match whole names
    finally:
        registry.unregister("test/evil-v0")


def test_allow_list_from_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EnvConfigError):
        registry.load_entry_point("tests.unit.envs.fakes:CountingEnv")
    monkeypatch.setenv(registry.MODULES_ENV_VAR, "somewhere.else, tests.unit.envs")
    factory = registry.load_entry_point("tests.unit.envs.fakes:CountingEnv")
    assert factory.__name__ == "CountingEnv"


def test_bad_entry_points() -> None:
    with pytest.raises(EnvConfigError, match="must look like"):
        registry.load_entry_point("envs.builtin")
    with pytest.raises(EnvConfigError, match="no attribute"):
        registry.load_entry_point("envs.builtin.guess_number:Nope")
    with pytest.raises(EnvConfigError, match="cannot import"):
        registry.load_entry_point("envs.missing_module:X")
    with pytest.raises(EnvConfigError, match="already registered"):
        registry.register("agentflow/guess-number-v0", GuessNumberEnv)


async def test_max_episode_steps_truncates() -> None:
    registry.register("test/short-v0", GuessNumberEnv, max_episode_steps=2, replace=True)
    try:
        env = registry.make("test/short-v0")
        await env.reset(seed=0, options={"target": 16})
        assert not (await env.step(TextAction(text="1"))).done
        result = await env.step(TextAction(text="1"))
        assert result.truncated and not result.terminated
        with pytest.raises(EpisodeFinished):
            await env.step(TextAction(text="1"))
        assert (await env.state())["time_limit"] == 2
        await env.close()
    finally:
        registry.unregister("test/short-v0")


async def test_resolve_each_kind() -> None:
    python_spec = parse_spec(
        "python", {"entry_point": "envs.builtin.guess_number:GuessNumberEnv", "kwargs": {"high": 4}}
    )
    env = registry.resolve(python_spec)
    assert isinstance(env, GuessNumberEnv) and env.high == 4

    refused = parse_spec("python", {"entry_point": "os:system"})
    with pytest.raises(EnvConfigError, match="allow-list"):
        registry.resolve(refused)

    remote = registry.resolve(
        parse_spec("http", {"url": "http://127.0.0.1:9/", "env_id": "a/b-v0"})
    )
    assert isinstance(remote, RemoteEnv) and remote.env == "a/b-v0"
    await remote.close()

    container = parse_spec("container", {"image": "x:1", "command": ["serve"]})
    with pytest.raises(EnvConfigError, match="container runtime"):
        registry.resolve(container)

    browser = parse_spec("browser", {"task": "miniwob/click-button-v0"})
    made = registry.resolve(browser)  # the built-in resolver: nothing starts before reset
    assert type(made).__name__ == "BrowserEnv"
    await made.close()
    family = registry.kind("browser")  # a kind's resolver can be replaced
    registry.register_kind("browser", family.spec, lambda spec: GuessNumberEnv(), replace=True)
    try:
        assert isinstance(registry.resolve(browser), GuessNumberEnv)
    finally:
        registry.register_kind("browser", family.spec, family.resolver, replace=True)


class _Point:
    """An entry point of the `agentflow.envs` group, as importlib.metadata gives it."""

    def __init__(self, name: str, register) -> None:
        self.name, self._register = name, register

    def load(self):
        return self._register


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """The registry as a new process finds it: no family loaded yet, python kind only."""
    monkeypatch.setattr(registry, "_registry", {})
    monkeypatch.setattr(registry, "_kinds", {"python": registry._kinds["python"]})
    monkeypatch.setattr(registry, "_family_errors", {})
    monkeypatch.setattr(registry, "_families_loaded", False)

    def install(*points: _Point) -> None:
        monkeypatch.setattr(registry, "entry_points", lambda group: list(points))

    return install


def test_families_load_on_first_use_and_a_broken_one_is_named(fresh_registry) -> None:
    def good() -> None:
        registry.register("lab/good-v0", GuessNumberEnv)  # a family's own calls re-enter

    def broken() -> None:
        raise ImportError("no module named 'suite'")

    fresh_registry(_Point("good", good), _Point("broken", broken))
    assert registry.registered() == ["lab/good-v0"]
    with pytest.raises(UnknownEnv, match="env family 'broken' failed to load: ImportError"):
        registry.make("lab/missing-v0")


def test_without_any_family_the_error_says_to_install_the_package(fresh_registry) -> None:
    fresh_registry()
    with pytest.raises(UnknownEnv, match="no env families are installed"):
        registry.spec("agentflow/guess-number-v0")


def test_kinds_come_from_families_and_are_checked(fresh_registry) -> None:
    from envs.specs import HttpEnvSpec

    def http_family() -> None:
        registry.register_kind("http", HttpEnvSpec, lambda spec: GuessNumberEnv())

    fresh_registry(_Point("http", http_family))
    assert registry.kinds() == ["http", "python"]
    with pytest.raises(ValueError, match=r"unknown env kind 'browser'; expected one of \("):
        registry.parse_spec("browser", {"task": "miniwob/click-button-v0"})
    with pytest.raises(EnvConfigError, match="already registered"):
        registry.register_kind("http", HttpEnvSpec, lambda spec: GuessNumberEnv())
    with pytest.raises(EnvConfigError, match="invalid env kind"):
        registry.register_kind("Not A Kind", HttpEnvSpec, lambda spec: GuessNumberEnv())
    spec = registry.parse_spec("http", {"url": "http://127.0.0.1:9/"})
    assert isinstance(registry.resolve(spec), GuessNumberEnv)
