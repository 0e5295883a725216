"""A browser pool per test module (Chromium starts once per module), and a way to see
which Chromium processes this test process started, so a test can check they are gone.

Other processes on the machine may run Chromium too, so processes are counted among
this process's descendants, not machine-wide.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from envs.browser.chromium import chromium_executable
from envs.browser.pool import BrowserPool


def _parents() -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def chromium_descendants() -> set[int]:
    """Live Chromium processes under this one (through the Playwright driver)."""
    parents = _parents()
    mine, changed = {os.getpid()}, True
    while changed:
        more = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= more
        changed = bool(more)
    out = set()
    for pid in mine:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if "chrom" in comm and alive(pid):
            out.add(pid)
    return out


@pytest.fixture(scope="session", autouse=True)
def _needs_chromium() -> None:
    chromium_executable()  # fails the run with a clear message when there is none


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool() -> AsyncIterator[BrowserPool]:
    """One warm browser shared by a module's tests, closed at its end. No spares: tests
    reset few episodes per task, so contexts prepared ahead would mostly go unused."""
    shared = BrowserPool(1, spares=0, idle_close_s=None)
    yield shared
    await shared.aclose()
