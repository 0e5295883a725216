from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentflow.config import DEFAULT_DATABASE_URL, Settings


def test_defaults_to_a_sqlite_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTFLOW_DATABASE_URL", raising=False)
    assert Settings().database_url == DEFAULT_DATABASE_URL


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ],
)
def test_plain_urls_get_async_drivers(given: str, expected: str) -> None:
    assert Settings(database_url=given).database_url == expected


def test_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFLOW_API_KEY", "k")
    monkeypatch.setenv("AGENTFLOW_DATABASE_URL", "sqlite:///y.db")
    settings = Settings()
    assert (settings.api_key, settings.database_url) == ("k", "sqlite+aiosqlite:///y.db")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"database_url": "mysql://x"}, "database_url"),
        ({"environment": "staging"}, "environment"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(**kwargs)  # type: ignore[arg-type]
    assert info.value.errors()[0]["loc"] == (field,)


def test_production_needs_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTFLOW_API_KEY", raising=False)
    with pytest.raises(ValidationError, match="AGENTFLOW_API_KEY"):
        Settings(environment="production")
    with pytest.raises(ValidationError, match="AGENTFLOW_SECRET_KEY"):
        Settings(environment="production", api_key="k")
    settings = Settings(environment="production", api_key="k", secret_key="s" * 32)
    assert settings.api_key == "k"


def test_the_gc_threshold_is_three_integers_or_python_s_own() -> None:
    import gc

    before = gc.get_threshold()
    try:
        Settings(gc_threshold=" 5000, 20 ,30").apply_gc_threshold()
        assert gc.get_threshold() == (5000, 20, 30)
        gc.set_threshold(*before)
        Settings(gc_threshold="").apply_gc_threshold()
        assert gc.get_threshold() == before  # empty leaves Python's own
    finally:
        gc.set_threshold(*before)
    for bad in ("1,2", "a,b,c", "1,2,-3"):
        with pytest.raises(ValidationError, match="three non-negative integers"):
            Settings(gc_threshold=bad)
