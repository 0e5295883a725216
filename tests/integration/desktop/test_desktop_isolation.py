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


@pytest.mark.parametrize("unsafe_host_user", [False, True], ids=["sandbox", "host-user"])
async def test_two_desktops_are_isolated(runtime_dir: Path, unsafe_host_user: bool) -> None:
    provider = LocalDesktopProvider(
        runtime_dir=runtime_dir,
        max_desktops=2,
        capacity_wait_s=0.2,
        unsafe_host_user=unsafe_host_user,
    )
    try:
        one, two = await asyncio.gather(provider.start((800, 600)), provider.start((640, 480)))
        # Sandboxed, each has display :0 in its own namespaces; on the host, its own number.
        assert (
            (one.display == two.display == ":0")
            if not unsafe_host_user
            else (one.display != two.display)
        )
        assert len({one.vnc_port, one.ws_port, two.vnc_port, two.ws_port}) == 4
        assert one.home != two.home and one.home is not None and two.home is not None
        assert one.shell is not None and two.shell is not None
        await one.shell.write_file("~/secret.txt", b"one")
        assert await two.shell.read_file("secret.txt") is None
        assert (one.home / "secret.txt").read_bytes() == b"one"
        for desktop, size in ((one, "800 600"), (two, "640 480")):
            assert desktop.shell is not None
            seen = await desktop.shell.run("echo $DISPLAY $HOME; xdotool getdisplaygeometry")
            home = str(desktop.home) if unsafe_host_user else "/home/desktop"
            assert seen.stdout.split() == [desktop.display, home, *size.split()]
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


def is_mount_point(path: Path) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == str(path) for line in f)


async def test_a_dead_owners_sandboxed_desktop_is_unmounted_and_removed(runtime_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root mounts the sandboxed desktop's home and /tmp")
    provider = LocalDesktopProvider(runtime_dir=runtime_dir)
    desktop = await provider.start((640, 480))
    assert desktop.home is not None and is_mount_point(desktop.home)
    sandbox_dir = desktop.home.parent
    # The owner "crashed": its record stays, the processes and mounts with it.
    record = json.loads((runtime_dir / desktop.id / OWNER_FILE).read_text())
    assert record["sandbox_dir"] == str(sandbox_dir)
    running = provider._running.pop(desktop.id)  # forget it without tearing it down
    assert running.sandbox is not None and running.sandbox.process is not None
    running.sandbox.process.kill()
    await running.sandbox.process.wait()
    for relay in running.sandbox._relays:  # this process lives on: its listeners go
        relay.close()
    record["owner_pid"] = 2**22 + 1
    (runtime_dir / desktop.id / OWNER_FILE).write_text(json.dumps(record))
    assert is_mount_point(sandbox_dir / "tmp")

    heir = LocalDesktopProvider(runtime_dir=runtime_dir)
    other = await heir.start((640, 480))
    await heir.aclose()
    await provider.aclose()
    assert not is_mount_point(desktop.home) and not sandbox_dir.exists()
    assert not (runtime_dir / desktop.id).exists() and other.home is not None
    assert not other.home.parent.exists()
    if running.sandbox.cgroup is not None:  # what the crash left of it; the test's to free
        running.sandbox.cgroup.remove()
