"""Nothing outlives a desktop: not after close(), not after a cancelled reset, not after
SIGKILL of the Python process that owned the provider and its Chromium."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from envs.desktop.env import DesktopEnv
from envs.desktop.local import LocalDesktopProvider
from envs.desktop.novnc import ChromiumHost
from envs.desktop.tasks import TASKS
from tests.integration.desktop.conftest import NAMES, tagged, under, wait_until_gone

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]

OWNER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from envs.desktop.env import DesktopEnv
    from envs.desktop.local import LocalDesktopProvider
    from envs.desktop.tasks import TASKS

    async def main():
        provider = LocalDesktopProvider(runtime_dir=Path(sys.argv[1]))
        env = DesktopEnv(TASKS["terminal-echo"], provider=provider, screen=(640, 480))
        await env.reset()
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_close_and_cancellation_leave_nothing(runtime_dir: Path) -> None:
    provider = LocalDesktopProvider(runtime_dir=runtime_dir)
    host = ChromiumHost()
    try:
        env = DesktopEnv(TASKS["terminal-echo"], provider=provider, host=host, screen=(640, 480))
        await env.reset()
        assert {"Xvfb", "openbox", "x11vnc", "websockify", "xterm"} <= set(
            under(runtime_dir).values()
        )
        await env.close()
        assert under(runtime_dir) == {}
        for delay in (0.05, 0.3, 1.0):  # while processes start, the terminal opens, the page loads
            env = DesktopEnv(
                TASKS["terminal-echo"], provider=provider, host=host, screen=(640, 480)
            )
            reset = asyncio.ensure_future(env.reset())
            await asyncio.sleep(delay)
            reset.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reset
            await env.close()
            assert under(runtime_dir) == {}, f"left after a cancel at {delay} s"
            assert provider.running == []
    finally:
        await host.aclose()
        await provider.aclose()
    assert list(runtime_dir.iterdir()) == []


async def test_sigkill_of_the_owner_leaves_nothing(runtime_dir: Path) -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, "AGENTFLOW_TEST_TAG": tag, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(runtime_dir)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert owner.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 60)
        assert line == b"ready\n", line
        # Chromium and its driver carry the tag; desktop processes get a clean environment.
        owned = lambda: {**tagged(tag), **under(runtime_dir)}  # noqa: E731
        before = sorted(n for n in owned().values() if n.startswith(NAMES))
        assert {"Xvfb", "openbox", "x11vnc", "websockify", "xterm"} <= set(before)
        assert any(n.startswith(("chromium", "chrome")) for n in before), before
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        await wait_until_gone(owned)
        assert len(list(runtime_dir.iterdir())) == 1  # its folder waits for the next provider
        provider = LocalDesktopProvider(runtime_dir=runtime_dir)
        desktop = await provider.start((640, 480))
        assert [p.name for p in runtime_dir.iterdir()] == [desktop.id]
        await provider.aclose()
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
