"""The bubblewrap backend doing ordinary work: files, stdin, env, cwd, exit codes,
reset, cancellation and close."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from sandbox import ExecStatus, SandboxClosed, open_sandbox
from sandbox.pool import SandboxPool

from .procscan import sandbox_processes

pytestmark = pytest.mark.integration


async def test_files_stdin_env_cwd_and_exit_codes(make_sandbox):
    sb = make_sandbox()
    await sb.write_file(
        "pkg/prog.py",
        "import sys, os\nprint(sys.stdin.read().upper(), "
        "os.environ['GREETING'], os.getcwd())\nsys.exit(3)\n",
    )
    result = await sb.exec(["python3", "prog.py"], stdin="abc", cwd="pkg", env={"GREETING": "hi"})
    assert result.status is ExecStatus.FINISHED and result.exit_code == 3
    assert result.stdout == "ABC hi /work/pkg\n"
    made = await sb.exec("echo out > result.txt && id -u > uid.txt")
    assert made.exit_code == 0
    assert await sb.read_file("result.txt") == b"out\n"
    assert await sb.read_file("uid.txt") == b"65534\n"
    assert sorted(await sb.list_files()) == ["pkg/prog.py", "result.txt", "uid.txt"]
    missing = await sb.exec(["no-such-program"])
    assert missing.status is ExecStatus.ERROR and "no-such-program" in missing.stderr


async def test_concurrent_execs_in_one_sandbox(make_sandbox):
    sb = make_sandbox()
    results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(4)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


async def test_cancelled_exec_leaves_nothing_running(make_sandbox):
    sb = make_sandbox()
    task = asyncio.create_task(sb.exec("sleep 30"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert sandbox_processes(sb.workdir) == [] and sandbox_processes(sb.id) == []


async def test_an_exec_cancelled_while_it_starts_ends_at_once_and_leaves_nothing(make_sandbox):
    # Cancelled a few loop turns in: inside asyncio's start of bwrap, whose own clean-up
    # could wait for ever on pipes that bwrap's orphaned namespace init held open.
    sb = make_sandbox()
    for turns in (0, 1, 2, 3, 4, 6, 8, 12) * 2:
        task = asyncio.create_task(sb.exec("sleep 30"))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await task
    async with asyncio.timeout(10):
        while sandbox_processes(sb.workdir) or sandbox_processes(sb.id):
            await asyncio.sleep(0.05)


async def test_reset_empties_the_work_dir_and_close_is_final():
    sb = open_sandbox("bwrap")
    await sb.write_file("a/b.txt", "x")
    await sb.reset()  # type: ignore[attr-defined]
    assert await sb.list_files() == []  # type: ignore[attr-defined]
    workdir = sb.workdir  # type: ignore[attr-defined]
    await sb.close()
    await sb.close()
    assert not os.path.exists(workdir)
    with pytest.raises(SandboxClosed):
        await sb.exec("true")


async def test_warm_pool_of_bwrap_sandboxes_recycles_clean():
    pool = SandboxPool(lambda: open_sandbox("bwrap"), size=2, recycle=True)
    await pool.start()
    async with pool.acquire() as sb:
        await sb.exec("echo secret > left-behind.txt")
    async with pool.acquire() as sb2, pool.acquire() as sb3:
        for other in (sb2, sb3):
            assert (await other.exec("ls")).stdout == ""
    await pool.close()


async def test_transient_setup_failure_is_retried(make_sandbox):
    # A stand-in for bwrap that fails to fork its init once (EAGAIN), then works. It runs
    # as host nobody, so it lives in a directory nobody can reach.
    with tempfile.TemporaryDirectory(prefix="fake-bwrap-") as tmp:
        d = Path(tmp)
        d.chmod(0o777)
        script = d / "bwrap"
        script.write_text(
            "#!/bin/sh\n"
            f"if [ ! -e {d}/tried ]; then touch {d}/tried\n"
            '  echo "bwrap: Can\'t fork for pid 1: Resource temporarily unavailable" >&2\n'
            "  exit 1\n"
            "fi\necho ran\n"
        )
        script.chmod(0o755)
        sb = make_sandbox(bwrap_path=str(script))
        result = await sb.exec("true")
        assert result.status is ExecStatus.FINISHED and result.stdout == "ran\n"
        assert (d / "tried").exists()
