"""agentflow.stack's parts that need no engine: the mirror debootstrap uses, the refusals
of a bad project, and the CLI's error for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentflow.stack import Stack, StackError, _cached_wheels, _deps_key, debian_mirror
from trainer.cli import app


def test_mirror_from_a_deb822_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTFLOW_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\n# a comment: with a colon\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
    )
    assert debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_a_one_line_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTFLOW_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian buster main\n"
        "deb [arch=amd64] http://mirror.example/debian bookworm main\n"
    )
    assert debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_override_and_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTFLOW_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian trixie main\n")
    with pytest.raises(StackError, match="AGENTFLOW_DEBIAN_MIRROR"):
        debian_mirror(tmp_path)  # a trixie host has no bookworm source to reuse
    monkeypatch.setenv("AGENTFLOW_DEBIAN_MIRROR", "http://mine.example/debian")
    assert debian_mirror(tmp_path) == "http://mine.example/debian"


def test_a_directory_without_a_compose_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="no docker-compose.yml"):
        Stack(tmp_path)
    result = CliRunner().invoke(app, ["stack", "down", "--project-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no docker-compose.yml" in result.output


def test_the_deps_key_follows_the_image_requirements_only(tmp_path: Path) -> None:
    def key(dependencies: str, extras: str, tool: str = "") -> str:
        (tmp_path / "pyproject.toml").write_text(
            f'[project]\nname = "agentflow"\ndependencies = [{dependencies}]\n'
            f"[project.optional-dependencies]\n{extras}\n{tool}"
        )
        return _deps_key(tmp_path)

    extras = 'torch = ["torch==2.13.0"]\nenvs = []\ndocker = []\ndev = ["pytest"]'
    base = key('"httpx"', extras)
    assert key('"httpx"', extras, "[tool.pytest.ini_options]\naddopts = '-x'") == base
    assert key('"httpx"', extras.replace('"pytest"', '"pytest<9"')) == base  # not an image's
    assert key('"httpx>=0.28"', extras) != base
    assert key('"httpx"', extras.replace("envs = []", 'envs = ["agentflow[lora]"]')) == base
    lora = extras.replace("envs = []", 'envs = ["agentflow[lora]"]') + '\nlora = ["peft"]'
    assert key('"httpx"', lora) != base  # an extra named through the project's own extras


def test_a_wheelhouse_is_built_once_and_copied_into_each_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTFLOW_WHEEL_CACHE", str(tmp_path / "cache"))
    builds: list[Path] = []

    def build(into: Path) -> None:
        builds.append(into)
        (into / "dep-1.0-py3-none-any.whl").write_bytes(b"wheel")

    first, second = tmp_path / "one" / "deps", tmp_path / "two" / "deps"
    _cached_wheels("deps", "a" * 64, first, build)
    _cached_wheels("deps", "a" * 64, second, build)
    assert len(builds) == 1  # the second checkout copied the first's
    for target in (first, second):
        assert [p.name for p in target.iterdir()] == ["dep-1.0-py3-none-any.whl"]
        assert (target / "dep-1.0-py3-none-any.whl").read_bytes() == b"wheel"

    # New requirements build again and replace what the old ones left in the cache.
    _cached_wheels("deps", "b" * 64, first, build)
    assert len(builds) == 2
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["deps-" + "b" * 16]

    # A build that fails leaves nothing kept: the next one builds again.
    def broken(into: Path) -> None:
        (into / "half.whl").write_bytes(b"")
        raise StackError("pip wheel failed")

    with pytest.raises(StackError):
        _cached_wheels("deps", "c" * 64, first, broken)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["deps-" + "b" * 16]
