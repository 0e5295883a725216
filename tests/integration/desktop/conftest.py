"""Real desktops (Xvfb, openbox, x11vnc, websockify/noVNC) and a real Chromium.

Processes are counted by what their environment says, not by name: every desktop
process has `AGENTFLOW_DESKTOP=<id>` and either `AGENTFLOW_DESKTOP_FOLDER=<runtime
dir>/<id>` (sandboxed, the default) or `HOME=<runtime dir>/<id>/home` (host user), and a child
Python started by a test carries a tag its descendants inherit, so other users of the
machine (a parallel browser test's Chromium) never change the counts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from envs.desktop.processes import OWNER_ENV

NAMES = ("Xvfb", "openbox", "x11vnc", "websockify", "xterm", "chromium", "chrome")

_NEEDED = ("Xvfb", "openbox", "x11vnc", "websockify", "xdotool")
_MISSING = [c for c in _NEEDED if not shutil.which(c)]
if _MISSING:
    # The README's test command installs them; a silent skip would hide a broken setup.
    raise pytest.UsageError(
        f"desktop tests need {', '.join(_MISSING)}: run the README's test command, which "
        "installs the Debian packages"
    )


def processes(matches: Callable[[list[bytes]], bool]) -> dict[int, str]:
    """Live processes whose environment passes `matches`: pid -> command name."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry.name}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if environ != [b""] and matches(environ):  # a zombie's environ reads empty
            found[int(entry.name)] = name
    return found


def under(runtime_dir: Path) -> dict[int, str]:
    """Processes of the desktops under `runtime_dir`."""
    prefixes = (f"HOME={runtime_dir}/".encode(), f"{OWNER_ENV}={runtime_dir}/".encode())
    return processes(lambda environ: any(v.startswith(prefixes) for v in environ))


def tagged(tag: str) -> dict[int, str]:
    needle = f"AGENTFLOW_TEST_TAG={tag}".encode()
    return processes(lambda environ: needle in environ)


async def wait_until_gone(find: Callable[[], dict[int, str]], timeout_s: float = 10.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := find()) and loop.time() < deadline:
        await asyncio.sleep(0.1)
    assert not left, f"processes left behind: {left}"


async def wait_until_seen(find: Callable[[], dict[int, str]], timeout_s: float = 10.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (seen := find()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert seen, "no process showed up"


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    return tmp_path / "desktops"
