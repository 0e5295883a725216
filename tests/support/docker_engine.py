"""A Docker engine for the tests that need one, started here when none answers.

The README's set-up command installs docker.io, docker-compose and debootstrap, so the
suite runs these tests for real: a missing engine that cannot be started is a failure,
not a skip. ``AGENTFLOW_TESTS_WITHOUT_DOCKER=1`` skips them instead, on purpose (a
machine where dockerd cannot run, such as one without root).

An engine started here is stopped at the end of the test run; one that was running
already is left as it was. Under pytest-xdist several workers use one engine: the first
that needs it starts it (under a file lock) and notes its pid for the run, and the
controller stops it once every worker has finished (`stop_shared_engine`). Images
persist in the engine's storage between runs, so builds after the first are cached;
builds take `images_lock()`, so two workers never write one wheelhouse at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentflow.stack import StackError, StartedEngine, start_engine

SKIP_ENV = "AGENTFLOW_TESTS_WITHOUT_DOCKER"
RUN_ENV = "AGENTFLOW_TEST_RUN_ID"  # set by the controller, inherited by its workers
_OUTLIVING: list[StartedEngine] = []


def _path(name: str) -> Path:
    return Path(tempfile.gettempdir()) / name


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    with _path(name).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def images_lock() -> contextlib.AbstractContextManager[None]:
    """Held while a test builds images (and writes the wheelhouse they copy)."""
    return _locked("agentflow-test-images.lock")


def _marker() -> Path | None:
    """Where the run's shared engine's pid is noted; None outside an xdist worker."""
    run = os.environ.get(RUN_ENV)
    if not run or "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return _path(f"agentflow-test-dockerd-{run}.pid")


def docker_engine() -> Iterator[None]:
    """Body of the session fixture ``docker_engine`` (tests/conftest.py)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the Docker engine tests are skipped")
    marker = _marker()
    log = Path(tempfile.gettempdir()) / f"agentflow-test-dockerd-{os.getpid()}.log"
    with _locked("agentflow-test-dockerd.lock"):
        try:
            started = start_engine(log)  # None when one answers already
        except StackError as exc:
            pytest.fail(f"no Docker engine for the tests: {exc} (or set {SKIP_ENV}=1)")
        if started is not None and marker is not None:
            marker.write_text(str(started.process.pid))  # the controller stops it
            _OUTLIVING.append(started)  # never collected here: it runs past this worker
    try:
        yield
    finally:
        if started is not None and marker is None:
            started.stop()


def stop_shared_engine() -> None:
    """On the controller, at the end of the run: stop the engine a worker started."""
    run = os.environ.get(RUN_ENV)
    if not run:
        return
    marker = _path(f"agentflow-test-dockerd-{run}.pid")
    if not marker.is_file():
        return
    pid = int(marker.read_text())
    marker.unlink()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (its starter, a worker, has exited; init reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
