"""Which Chromium binary a browser env launches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from envs.base import EnvConfigError
from envs.browser.chromium import CHROMIUM_ENV_VAR, chromium_executable


def _binary(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(CHROMIUM_ENV_VAR, raising=False)
    return tmp_path


def test_headless_prefers_the_headless_shell(bin_dir: Path) -> None:
    full = _binary(bin_dir, "chromium")
    shell = _binary(bin_dir, "chromium-headless-shell")
    assert chromium_executable(headless=True) == str(shell)
    assert chromium_executable(headless=False) == str(full)  # a headed browser needs the full one


def test_headless_falls_back_to_the_full_browser(bin_dir: Path) -> None:
    full = _binary(bin_dir, "chromium")
    assert chromium_executable(headless=True) == str(full)


def test_the_environment_variable_wins(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _binary(bin_dir, "chromium-headless-shell")
    mine = _binary(bin_dir, "my-chrome")
    monkeypatch.setenv(CHROMIUM_ENV_VAR, str(mine))
    assert chromium_executable(headless=True) == str(mine)
    monkeypatch.setenv(CHROMIUM_ENV_VAR, str(bin_dir / "missing"))
    with pytest.raises(EnvConfigError, match="not an executable file"):
        chromium_executable()


def test_none_found_says_what_to_install(bin_dir: Path) -> None:
    assert not os.listdir(bin_dir)
    with pytest.raises(EnvConfigError, match="chromium-headless-shell"):
        chromium_executable(headless=True)
