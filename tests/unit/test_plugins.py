"""`load_function`: dotted paths import only from allowed modules, and every refusal names
its field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentflow.errors import InvalidInput
from agentflow.plugins import allowed_modules, call, load_function
from tests.support import plugins

FIELD = ("envs", "0", "reward")


@pytest.fixture(autouse=True)
def allow_test_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", " tests.support , ,other.pkg.")


def test_an_allowed_function_loads() -> None:
    assert load_function("tests.support.plugins:text_length", field=FIELD) is plugins.text_length
    assert load_function("agentflow.plugins:load_function", field=FIELD) is load_function
    assert load_function("tests.support.plugins:GuessNumberOracleAgent.run", field=FIELD)


def test_the_allow_list_is_agentflow_and_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allowed_modules() == ["agentflow", "tests.support", "other.pkg"]
    monkeypatch.delenv("AGENTFLOW_PLUGIN_MODULES")
    assert allowed_modules() == ["agentflow"]
    with pytest.raises(InvalidInput, match="not on the plug-in allow-list"):
        load_function("tests.support.plugins:text_length", field=FIELD)


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("tests.support.plugins", "must look like 'package.module:function'"),
        (":text_length", "must look like"),
        ("tests.support.plugins:", "must look like"),
        ("os:system", "'os' is not on the plug-in allow-list"),
        ("agentflowx.evil:run", "not on the plug-in allow-list"),  # a prefix, not a package
        ("tests.supportive:f", "not on the plug-in allow-list"),
        ("tests.support.no_such_module:f", "cannot import 'tests.support.no_such_module'"),
        ("tests.support.plugins:no_such_function", "has no attribute 'no_such_function'"),
        ("tests.support.plugins:NOT_CALLABLE", "is int, not callable"),
    ],
)
def test_refusals_name_the_field(path: str, says: str) -> None:
    with pytest.raises(InvalidInput) as info:
        load_function(path, field=FIELD)
    assert info.value.field == FIELD
    assert says in info.value.message


def test_a_refused_module_is_never_imported() -> None:
    sys.modules.pop("this", None)  # importing `this` prints the Zen of Python
    with pytest.raises(InvalidInput):
        load_function("this:d", field="agent.entry_point")
    assert "this" not in sys.modules


def test_a_module_that_fails_to_import_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "broken_plugin")
    with pytest.raises(InvalidInput) as info:
        load_function("broken_plugin:f", field=("agent", "entry_point"))
    assert info.value.field == ("agent", "entry_point")
    assert info.value.message == "cannot import 'broken_plugin': RuntimeError: half-written"


async def test_sync_and_async_plugins_are_called() -> None:
    async def twice(x: int) -> int:
        return 2 * x

    assert await call(lambda x: x + 1, 1) == 2
    assert await call(twice, 2) == 4
