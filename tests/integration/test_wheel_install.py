"""A wheel, installed without the source tree, migrates a fresh database and serves.

The wheel is built offline (no build isolation, with the dev environment's setuptools)
from a copy of the sources, and installed (not editable) into a fresh virtual
environment that borrows the dev environment's dependencies through a `.pth` file.
Every command runs outside the repository, so only the installed package is importable.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import inspect

from agentflow.db import migrate
from agentflow.db.models import Base
from agentflow.db.session import create_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject.toml's packages, their migrations, the readme).
SOURCES = ("pyproject.toml", "README.md", "agentflow", "envs", "sandbox", "trainer", "alembic")


@dataclass
class Installed:
    venv: Path
    workdir: Path  # outside the repository: the cwd of every command
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def agentflow(self) -> Path:
        return self.venv / "bin" / "agentflow"

    def run(self, *args: str | Path, url: str | None = None) -> str:
        env = dict(self.env, AGENTFLOW_DATABASE_URL=url) if url else self.env
        done = subprocess.run(
            [str(a) for a in args],
            cwd=self.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout


def _clean_env() -> dict[str, str]:
    """The caller's environment without anything that would steer imports or settings."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AGENTFLOW_")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel_install")
    env = _clean_env()

    src = root / "src"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    wheels = root / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index"]
    subprocess.run(
        [*pip_wheel, "--no-build-isolation", "-w", str(wheels), str(src)],
        cwd=root,
        env=env,
        check=True,
        timeout=180,
    )
    (wheel,) = wheels.glob("agentflow-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    versions = sorted(p.name for p in (REPO / "alembic" / "versions").glob("*.py"))
    shipped = {"env.py", "script.py.mako", *(f"versions/{v}" for v in versions)}
    assert {f"agentflow/_migrations/{f}" for f in shipped} <= names
    assert not any(n.startswith("alembic/") for n in names)  # would shadow the library
    static = {p.name for p in (REPO / "agentflow" / "ui" / "static").iterdir()}
    assert {f"agentflow/ui/static/{f}" for f in static} <= names  # the dashboard's files

    venv = root / "venv"
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The dev environment's dependencies (and pip), after the fresh venv's own site-packages.
    ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (Path(site) / "_agentflow_dev_deps.pth").write_text("\n".join(ours) + "\n")

    workdir = root / "work"
    workdir.mkdir()
    inst = Installed(venv=venv, workdir=workdir, env=env)
    # Not editable (`--ignore-installed`: the dev environment's agentflow is left alone).
    pip_install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    inst.run(*pip_install, "--ignore-installed", wheel)
    return inst


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    return str(request.getfixturevalue("empty_pg_url"))


async def _revision_and_tables(url: str) -> tuple[str | None, set[str]]:
    engine = create_engine(url)
    try:
        revision = await migrate.current_revision(engine)
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()
    return revision, tables


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_installed_wheel_migrates_and_serves(installed: Installed, fresh_url: str) -> None:
    where = installed.run(
        installed.python,
        "-c",
        "import agentflow, agentflow.db.migrate as m; print(agentflow.__file__); "
        "print(m.script_location())",
    ).split()
    for path in where:
        assert Path(path).is_relative_to(installed.venv), where
        assert not Path(path).resolve().is_relative_to(REPO), where

    out = installed.run(installed.agentflow, "db", "upgrade", url=fresh_url)
    assert "database at head" in out
    revision, tables = asyncio.run(_revision_and_tables(fresh_url))
    assert revision is not None and revision == migrate.head_revision()
    assert set(Base.metadata.tables) <= tables

    port = _free_port()
    log = installed.workdir / f"serve-{port}.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [str(installed.agentflow), "serve", "--port", str(port)],
            cwd=installed.workdir,
            env=dict(installed.env, AGENTFLOW_DATABASE_URL=fresh_url),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline, status = time.monotonic() + 30, None
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    status = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code
                except httpx.TransportError:
                    status = None
                if status == 200:
                    break
                time.sleep(0.2)
            assert status == 200, f"/healthz answered {status}; server log:\n{log.read_text()}"
            # The dashboard's page and modules, read from the installed package.
            for path in ("/ui", "/ui/static/app.js", "/ui/static/style.css"):
                served = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
                assert served.status_code == 200 and served.content, path
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
