"""Shared fixtures: real databases with the migrations applied.

PostgreSQL tests run against the server at 127.0.0.1:5432 (trust auth). Each test
session makes its own database (from the `test` maintenance database) and drops it
afterwards, so parallel runs and other users of the server never collide.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from agentflow.db import migrate
from agentflow.db.session import create_engine
from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database

PG_ADMIN_URL = os.environ.get("AGENTFLOW_TEST_PG_URL", DEFAULT_ADMIN_URL)

# The suite starts hundreds of Python processes (gateways, trainers, Ray's workers); where
# the environment forbids writing bytecode, each compiles this project's modules again, and
# each worker pytest's rewritten test modules. The caches go to __pycache__ (git ignores it).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

if "PYTEST_XDIST_WORKER" in os.environ:
    # Several workers share the cores: torch in each (and in the processes its tests
    # start) takes one thread rather than all of them. Set before torch is imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# Under pytest-xdist (the README's test command: `-n 4 --dist loadgroup`), the units of
# work a worker takes one after another, longest first.
_SHARED_RESOURCE = 0  # the tests of a machine-wide resource: on one worker, in turn
_MODULE = 1  # a module whose fixtures outlive a test: on one worker, set up once
_SINGLE = 2  # every other test, spread one by one


def _work_unit(item: pytest.Item, modules_with_shared_fixtures: set[str]) -> tuple[int, str]:
    if "docker_engine" in getattr(item, "fixturenames", ()) or item.get_closest_marker("docker"):
        # One Docker engine for the run (tests/support/docker_engine.py); the compose
        # stacks on one worker, the other tests that need the engine on another.
        if item.nodeid.startswith("tests/integration/stack/"):
            return _SHARED_RESOURCE, "docker-stack"
        return _SHARED_RESOURCE, "docker"
    if item.get_closest_marker("vllm"):
        # One vLLM server per session, started by the first test that needs it.
        return _SHARED_RESOURCE, "vllm"
    module = item.nodeid.split("::")[0]
    if module in modules_with_shared_fixtures:
        return _MODULE, module
    return _SINGLE, ""


def _shares_fixtures(item: pytest.Item) -> bool:
    """Whether a fixture of `item` lives longer than the test (module, package, class):
    its module's tests on several workers would each set it up again."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definitions[-1].scope in ("module", "package", "class")
        for definitions in info.name2fixturedefs.values()
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests into xdist's units of work (`xdist_group`) and order the units so
    the long ones start first; without xdist the marks do nothing and only the order
    changes (each test stands alone)."""
    shared = {item.nodeid.split("::")[0] for item in items if _shares_fixtures(item)}
    units = {item.nodeid: _work_unit(item, shared) for item in items}
    for item in items:
        rank, group = units[item.nodeid]
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: units[item.nodeid][0])  # stable: modules stay in order


_UNGROUPED: set[str] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under `--dist loadgroup`, note the grouped tests xdist did not
    take as grouped (it marks a grouped test's id with `@group`)."""
    if getattr(session.config.option, "loadgroup", False):
        _UNGROUPED.update(
            item.nodeid
            for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, rather than run side by side on several workers, the grouped tests that
    xdist did not group."""
    if item.nodeid in _UNGROUPED:
        pytest.fail(
            "pytest-xdist did not group this test (this pytest and pytest-xdist do not work "
            "together): install the versions pyproject.toml names",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session; its URL."""
    with scratch_database(PG_ADMIN_URL, prefix="agentflow_test") as url:
        yield url


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database with no schema at all (for migration tests)."""
    with scratch_database(PG_ADMIN_URL, prefix="agentflow_empty", upgrade=False) as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_database(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh, migrated SQLite file for this test session; its URL."""
    path: Path = tmp_path_factory.mktemp("db") / "agentflow.db"
    url = f"sqlite+aiosqlite:///{path}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test that uses this runs on both databases."""
    name = "sqlite_database" if request.param == "sqlite" else "pg_database"
    return str(request.getfixturevalue(name))


@pytest.fixture
async def db_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    """A Docker engine that answers (started for this session if none did)."""
    from tests.support.docker_engine import docker_engine as engine

    yield from engine()


@pytest.fixture(scope="session")
def sandbox_runtime_image(docker_engine: None) -> str:
    """The Docker sandboxes' image, built (or found in the engine's cache) from this checkout."""
    from agentflow.stack import build_sandbox_runtime_image
    from tests.support.docker_engine import images_lock

    with images_lock():
        return build_sandbox_runtime_image(Path(__file__).resolve().parents[1])


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        from tests.support.docker_engine import RUN_ENV

        os.environ.setdefault(RUN_ENV, uuid.uuid4().hex)  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        from tests.support.docker_engine import stop_shared_engine

        stop_shared_engine()
