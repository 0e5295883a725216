"""A Docker engine for the tests that need one, started here when none answers.

The README's set-up command installs docker.io, docker-compose and debootstrap, so the
suite runs these tests for real: a missing engine that cannot be started is a failure,
not a skip. ``AGENTFLOW_TESTS_WITHOUT_DOCKER=1`` skips them instead, on purpose (a
machine where dockerd cannot run, such as one without root).

An engine started here is stopped at the end of the session; one that was running
already is left as it was. Images persist in the engine's storage between sessions,
so builds after the first are cached.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentflow.stack import StackError, engine_running, start_engine

SKIP_ENV = "AGENTFLOW_TESTS_WITHOUT_DOCKER"


def docker_engine() -> Iterator[None]:
    """Body of the session fixture ``docker_engine`` (tests/conftest.py)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the Docker engine tests are skipped")
    if engine_running():
        yield
        return
    log = Path(tempfile.gettempdir()) / f"agentflow-test-dockerd-{os.getpid()}.log"
    try:
        started = start_engine(log)
    except StackError as exc:
        pytest.fail(f"no Docker engine for the tests: {exc} (or set {SKIP_ENV}=1)")
    try:
        yield
    finally:
        if started is not None:
            started.stop()
