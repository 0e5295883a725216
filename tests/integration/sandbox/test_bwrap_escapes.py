"""Escape attempts against the real bubblewrap backend: each fails with a clear status,
the host and a second sandbox are unaffected, and nothing is left running."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from sandbox import ExecStatus, SandboxLimits

from .procscan import sandbox_processes

pytestmark = pytest.mark.integration

# The cgroup's memory limit is memory_mb + max_workdir_bytes (the work dir's tmpfs pages
# are charged there): a small work dir keeps that total well under what the tests allocate.
TIGHT = SandboxLimits(
    wall_time_s=3,
    cpu_time_s=2,
    memory_mb=128,
    max_processes=16,
    max_output_bytes=64 * 1024,
    max_workdir_bytes=16 * 1024 * 1024,
)


async def test_writes_outside_the_work_dir_fail(make_sandbox, tmp_path):
    sb = make_sandbox()
    name = f"escape-{uuid.uuid4().hex}"
    script = "; ".join(
        f"echo pwned > {target} 2>/dev/null && echo WROTE {target}"
        for target in (
            f"/{name}",
            f"/usr/{name}",
            f"/etc/{name}",
            f"/work/../{name}",
            f"{tmp_path}/{name}",
        )
    )
    result = await sb.exec(f"{script}; echo inside > /tmp/{name}; echo ok > mine.txt")
    assert result.status is ExecStatus.FINISHED
    assert "WROTE" not in result.stdout
    for host_path in (
        f"/{name}",
        f"/usr/{name}",
        f"/etc/{name}",
        f"{tmp_path}/{name}",
        f"/tmp/{name}",
    ):
        assert not os.path.exists(host_path), host_path  # /tmp inside is private too
    assert await sb.read_file("mine.txt") == b"ok\n"  # the work dir itself is writable


async def test_root_and_shadow_are_not_visible(make_sandbox):
    assert Path("/etc/shadow").exists() and Path("/root").is_dir()  # they exist on the host
    sb = make_sandbox()
    result = await sb.exec("cat /etc/shadow; ls /root; id -u; ls /")
    assert result.status is ExecStatus.FINISHED
    assert "No such file" in result.stderr
    lines = result.stdout.split()
    assert lines[0] == "65534" and "root" not in lines and "home" not in lines
    assert "root:" not in result.stdout


async def test_host_processes_are_invisible(make_sandbox):
    result = await make_sandbox().exec("ls /proc")
    pids = [int(p) for p in result.stdout.split() if p.isdigit()]
    assert len(pids) <= 3  # bwrap's init, the shell, ls: nothing of the host's


async def test_files_past_the_size_limit_are_cut(make_sandbox):
    sb = make_sandbox(limits=SandboxLimits(max_file_bytes=1 << 20))
    result = await sb.exec("head -c 3M /dev/zero > big.bin")
    assert result.status is ExecStatus.ERROR  # SIGXFSZ
    assert len(await sb.read_file("big.bin")) == 1 << 20


async def test_planted_symlinks_do_not_redirect_host_file_access(make_sandbox):
    sb = make_sandbox()
    await sb.exec("ln -s /etc/shadow leak; ln -s /etc linkdir")
    from sandbox import SandboxFileError

    with pytest.raises(SandboxFileError):
        await sb.read_file("leak")
    with pytest.raises(SandboxFileError):
        await sb.write_file("linkdir/evil", "x")
    with pytest.raises(SandboxFileError):
        await sb.read_file("../../etc/passwd")
    assert not Path("/etc/evil").exists()


async def _listener() -> tuple[asyncio.AbstractServer, int, list[int]]:
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


CONNECT = (
    "import socket, sys\n"
    "s = socket.socket()\ns.settimeout(2)\n"
    "try:\n    s.connect(('127.0.0.1', int(sys.argv[1])))\n    print('CONNECTED')\n"
    "except OSError as e:\n    print('FAILED', type(e).__name__)\n"
)


async def test_no_network_host_listener_is_unreachable(make_sandbox):
    server, port, connections = await _listener()
    async with server:
        isolated = await make_sandbox().exec(["python3", "-c", CONNECT, str(port)])
        assert isolated.status is ExecStatus.FINISHED
        assert isolated.stdout.startswith("FAILED"), isolated
        assert connections == []
        # Control: the same code with network=True reaches the listener, so the test bites.
        shared = await make_sandbox(network=True).exec(["python3", "-c", CONNECT, str(port)])
        assert shared.stdout.strip() == "CONNECTED", shared
        await asyncio.sleep(0.05)
        assert connections == [1]


FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
)


async def test_fork_bomb_is_contained_and_others_keep_working(make_sandbox):
    bomb = make_sandbox(limits=TIGHT)
    other = make_sandbox()

    async def meanwhile():
        await asyncio.sleep(0.5)  # while the bomb is at its limit
        return await other.exec(
            "for i in 1 2 3 4 5 6 7 8; do (echo $i); done; python3 -c 'print(6*7)'"
        )

    bombed, calm = await asyncio.gather(
        bomb.exec(["python3", "-c", FORK_BOMB], timeout_s=2), meanwhile()
    )
    assert bombed.status is ExecStatus.TIME_LIMIT and bombed.exit_code is None
    assert calm.status is ExecStatus.FINISHED and calm.stdout.split()[-1] == "42"
    assert sandbox_processes(bomb.id) == []  # the whole tree was killed at the deadline
    host = subprocess.run(["sh", "-c", "echo host-ok"], capture_output=True, text=True, check=True)
    assert host.stdout == "host-ok\n"
    if bomb.cgroup_enforced:
        # The pids cgroup held the bomb at its limit.
        assert (
            "pids" not in bomb.cgroup.dirs
            or int((bomb.cgroup.dirs["pids"] / "pids.max").read_text()) == TIGHT.max_processes
        )


async def test_allocation_past_the_memory_limit(make_sandbox):
    sb = make_sandbox(limits=TIGHT)
    one = await sb.exec(["python3", "-c", "b = bytearray(400 * 1024 * 1024)"])
    assert one.status is ExecStatus.MEMORY_LIMIT
    assert "MemoryError" in one.stderr


async def test_memory_spread_over_processes_hits_the_cgroup_limit(make_sandbox):
    sb = make_sandbox(limits=TIGHT)
    if not sb.cgroup_enforced:
        pytest.skip("no writable cgroup on this host: memory is bounded per process only")
    # Each child stays under the per-process address-space limit; together they do not.
    code = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        b = bytearray(90 * 1024 * 1024); time.sleep(1); os._exit(0)\n"
        "for _ in range(4):\n    os.wait()\n"
    )
    other = make_sandbox()
    result, calm = await asyncio.gather(
        sb.exec(["python3", "-c", code]), other.exec(["python3", "-c", "print(len(bytes(10**7)))"])
    )
    assert result.status is ExecStatus.MEMORY_LIMIT
    assert calm.status is ExecStatus.FINISHED and calm.stdout == "10000000\n"


async def test_loop_forever_hits_wall_time(make_sandbox):
    sb = make_sandbox(limits=TIGHT)
    result = await sb.exec("sleep 1000", timeout_s=0.5)
    assert result.status is ExecStatus.TIME_LIMIT and result.exit_code is None
    assert 0.5 <= result.duration_s < 3


async def test_busy_loop_hits_cpu_time(make_sandbox):
    sb = make_sandbox(limits=SandboxLimits(wall_time_s=5, cpu_time_s=1))
    result = await sb.exec(["python3", "-c", "while True: pass"])
    assert result.status is ExecStatus.TIME_LIMIT


async def test_printing_gigabytes_is_cut_off(make_sandbox):
    sb = make_sandbox(limits=TIGHT)
    result = await sb.exec("head -c 4G /dev/zero | tr '\\0' x")
    assert result.status is ExecStatus.ERROR and result.output_truncated
    assert len(result.stdout) == TIGHT.max_output_bytes
    assert "output limit" in result.stderr
    assert result.duration_s < TIGHT.wall_time_s  # killed at the cap, not at the deadline
