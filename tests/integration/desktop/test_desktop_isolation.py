"""Local desktops side by side: their own display, ports, home and screen; a capacity;
leftovers of a crashed owner reaped by the next provider."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from envs.base import EnvCapacity
from envs.desktop.local import LocalDesktopProvider
from envs.desktop.processes import MARKER_ENV, OWNER_FILE
from tests.integration.desktop.conftest import under, wait_until_gone, wait_until_seen

pytestmark = pytest.mark.integration


async def test_two_desktops_are_isolated(runtime_dir: Path) -> None:
    provider = LocalDesktopProvider(runtime_dir=runtime_dir, max_desktops=2, capacity_wait_s=0.2)
    try:
        one, two = await asyncio.gather(provider.start((800, 600)), provider.start((640, 480)))
        assert one.display != two.display
        assert len({one.vnc_port, one.ws_port, two.vnc_port, two.ws_port}) == 4
        assert one.home != two.home and one.home is not None and two.home is not None
        assert one.shell is not None and two.shell is not None
        await one.shell.write_file("~/secret.txt", b"one")
        assert await two.shell.read_file("secret.txt") is None
        assert (one.home / "secret.txt").read_bytes() == b"one"
        for desktop, size in ((one, "800 600"), (two, "640 480")):
            assert desktop.shell is not None
            seen = await desktop.shell.run("echo $DISPLAY $HOME; xdotool getdisplaygeometry")
            assert seen.stdout.split() == [desktop.display, str(desktop.home), *size.split()]
        leaked = await one.shell.run("env")
        assert "AGENTFLOW_" in leaked.stdout and "PYTEST" not in leaked.stdout
        with pytest.raises(ValueError, match="outside the desktop's home"):
            await one.shell.read_file("../../../etc/passwd")
        with pytest.raises(EnvCapacity):
            await provider.start((640, 480))
        await provider.stop(one)
        three = await provider.start((640, 480))  # the slot came back
        assert three.display is not None
    finally:
        await provider.aclose()
    await wait_until_gone(lambda: under(runtime_dir))
    assert list(runtime_dir.iterdir()) == []


async def test_a_new_provider_reaps_a_dead_owners_desktop(runtime_dir: Path) -> None:
    folder = runtime_dir / "deadbeef0001"
    (folder / "home").mkdir(parents=True)
    no_such_pid = 2**22 + 1  # above Linux's largest pid_max
    (folder / OWNER_FILE).write_text(json.dumps({"owner_pid": no_such_pid, "owner_start": 1}))
    env = {**os.environ, MARKER_ENV: "deadbeef0001", "HOME": str(folder / "home")}
    orphan = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        # Popen returns once exec has begun, a moment before the kernel publishes the new
        # program's environment in /proc; wait for it rather than race it.
        await wait_until_seen(lambda: under(runtime_dir))
        provider = LocalDesktopProvider(runtime_dir=runtime_dir)
        desktop = await provider.start((640, 480))
        await provider.aclose()
        assert orphan.wait(timeout=5) == -9
        assert not folder.exists() and desktop.home is not None
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
