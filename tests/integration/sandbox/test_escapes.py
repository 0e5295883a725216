"""Escape attempts against both real backends, bubblewrap and a Docker engine: each fails
with a clear status, the host and a second sandbox are unaffected, and nothing is left
running (the ``make_any_sandbox`` fixture checks that at teardown).

Where the backends block an attempt differently (a file missing versus not readable, a
status), the expectation is spelled out per backend; what is blocked is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from sandbox import ExecStatus, SandboxFileError, SandboxLimits
from sandbox.bwrap import BwrapSandbox
from sandbox.docker_backend import DockerSandbox

from .procscan import sandbox_processes

T = TypeVar("T")

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
KEEPER_UID = "65533"  # the Docker container's own init and `sleep infinity`


async def test_writes_outside_the_work_dir_fail(make_any_sandbox, tmp_path):
    sb = make_any_sandbox()
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


async def test_commands_run_unprivileged_on_a_read_only_root(make_any_sandbox):
    sb = make_any_sandbox()
    status = await sb.exec("grep -E '^(Uid|Gid|Cap[A-Za-z]+|NoNewPrivs):' /proc/self/status")
    fields = dict(line.split(":", 1) for line in status.stdout.splitlines())
    assert fields["Uid"].split() == ["65534"] * 4  # real, effective, saved, filesystem
    assert fields["Gid"].split() == ["65534"] * 4
    caps = {k: v.strip() for k, v in fields.items() if k.startswith("Cap")}
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"}
    assert set(caps.values()) == {"0" * 16}, caps  # none, not even to gain by setuid
    assert fields["NoNewPrivs"].strip() == "1"

    writes = await sb.exec(
        "for f in /etc/x /x /usr/x; do echo x > $f || echo FAILED $f; done; "
        "echo ok > /tmp/x && cat /tmp/x; "
        "for s in /var/run/docker.sock /run/docker.sock; do test -e $s && echo SOCKET $s; done"
    )
    assert writes.stdout == "FAILED /etc/x\nFAILED /x\nFAILED /usr/x\nok\n", writes
    assert writes.stderr.count("Read-only file system") == 3, writes
    assert "SOCKET" not in writes.stdout  # no way to the engine from inside


async def test_root_and_shadow_are_not_readable(make_any_sandbox, backend):
    assert Path("/etc/shadow").exists() and Path("/root").is_dir()  # they exist on the host
    sb = make_any_sandbox()
    result = await sb.exec("cat /etc/shadow; ls /root; id -u; ls /")
    assert result.status is ExecStatus.FINISHED
    lines = result.stdout.split()
    assert lines[0] == "65534"
    assert "root:" not in result.stdout
    if backend.name == "bwrap":
        # The host's are not mounted at all.
        assert "No such file" in result.stderr
        assert "root" not in lines and "home" not in lines
    else:
        # The image has its own; the sandbox user may read neither.
        assert "cat: /etc/shadow: Permission denied" in result.stderr, result
        assert "'/root': Permission denied" in result.stderr, result


LIST_PROCESSES = (
    "import json, os\n"
    "seen = []\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
    "            seen.append(f.read().decode(errors='replace').split('\\0'))\n"
    "    except OSError:\n"
    "        pass\n"
    "print(json.dumps(seen))\n"
)
# What each backend's own processes are: everything else would be the host's.
OWN_PROCESSES = {
    "bwrap": {"bwrap", "python3"},
    "docker": {"docker-init", "sleep", "timeout", "python3"},
}


async def test_host_processes_are_invisible(make_any_sandbox, backend):
    marker = f"host-marker-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        result = await make_any_sandbox().exec(["python3", "-c", LIST_PROCESSES])
    finally:
        host.kill()
        host.wait()
    assert result.status is ExecStatus.FINISHED, result
    seen = json.loads(result.stdout)
    assert seen and marker not in result.stdout
    assert {os.path.basename(argv[0]) for argv in seen} <= OWN_PROCESSES[backend.name], seen


async def test_files_past_the_size_limit_are_cut(make_any_sandbox):
    sb = make_any_sandbox(limits=SandboxLimits(max_file_bytes=1 << 20))
    result = await sb.exec("head -c 3M /dev/zero > big.bin")
    assert result.status is ExecStatus.ERROR and result.exit_code == 128 + 25  # SIGXFSZ
    assert len(await sb.read_file("big.bin")) == 1 << 20


async def _link_targets(sb: BwrapSandbox | DockerSandbox) -> str:
    """Size and mtime of the files the planted links point at, where they exist: on the
    host for bwrap (it maps host paths), in the container for Docker."""
    if isinstance(sb, BwrapSandbox):
        return " ".join(
            f"{st.st_size} {st.st_mtime_ns}" for st in map(os.stat, ("/etc/shadow", "/etc/passwd"))
        )
    result = await sb.exec("stat -c '%s %Y' /etc/shadow /etc/passwd")
    assert result.exit_code == 0, result
    return result.stdout


async def test_planted_symlinks_do_not_redirect_file_access(make_any_sandbox, backend):
    sb = make_any_sandbox()
    before = await _link_targets(sb)
    await sb.exec("ln -s /etc/shadow leak; ln -s /etc linkdir; ln -s /etc/passwd out")

    for path in ("leak", "linkdir/shadow", "linkdir/passwd", "../../etc/passwd"):
        with pytest.raises(SandboxFileError):
            await sb.read_file(path)
    if backend.name == "bwrap":
        with pytest.raises(SandboxFileError):
            await sb.write_file("linkdir/evil", "x")
        with pytest.raises(SandboxFileError):
            await sb.write_file("out", "x")
    else:
        # The engine replaces a planted symlink with what it writes: the write lands in
        # the work dir, the link's target is untouched.
        await sb.write_file("linkdir/evil", "x")
        await sb.write_file("out", "x")
        assert await sb.read_file("linkdir/evil") == b"x"
        assert await sb.read_file("out") == b"x"
        check = await sb.exec(
            "test -d linkdir && test ! -L linkdir && test -f out && test ! -L out && "
            "test ! -e /etc/evil && grep -q '^root:' /etc/passwd && echo intact"
        )
        assert check.stdout == "intact\n", check
    assert not Path("/etc/evil").exists()
    assert await _link_targets(sb) == before  # neither written nor replaced


async def _listener(host: str) -> tuple[asyncio.AbstractServer, int, list[int]]:
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(on_connect, host, 0)
    return server, server.sockets[0].getsockname()[1], connections


def host_ipv4_addresses() -> list[str]:
    """Every IPv4 address of this host's interfaces, loopback first."""
    text = Path("/proc/net/fib_trie").read_text()
    local = re.findall(r"\|-- (\d+\.\d+\.\d+\.\d+)\n\s+/32 host LOCAL", text)
    return ["127.0.0.1", *sorted(set(local) - {"127.0.0.1"})]


CONNECT = (
    "import socket, sys\n"
    "port = int(sys.argv[1])\n"
    "for host in sys.argv[2:]:\n"
    "    s = socket.socket()\n    s.settimeout(2)\n"
    "    try:\n        s.connect((host, port))\n        print('CONNECTED', host)\n"
    "    except OSError as e:\n        print('FAILED', host, type(e).__name__)\n"
    "    s.close()\n"
)


async def test_no_network_host_listener_is_unreachable(make_any_sandbox, backend):
    addresses = host_ipv4_addresses()
    server, port, connections = await _listener("0.0.0.0")
    async with server:
        for address in addresses:  # control: the listener answers on every address
            _, writer = await asyncio.open_connection(address, port)
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.05)
        assert len(connections) == len(addresses)
        connections.clear()

        sb = make_any_sandbox()
        isolated = await sb.exec(["python3", "-c", CONNECT, str(port), *addresses])
        assert isolated.status is ExecStatus.FINISHED
        assert isolated.stdout.splitlines() == [
            line for line in isolated.stdout.splitlines() if line.startswith("FAILED ")
        ]
        assert len(isolated.stdout.splitlines()) == len(addresses), isolated
        await asyncio.sleep(0.05)
        assert connections == []
        interfaces = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        assert interfaces.stdout == "lo\n"

        # Control: the same code reaches a listener on the sandbox's own loopback.
        inside = await sb.exec(
            [
                "python3",
                "-c",
                "import socket, subprocess, sys\n"
                "srv = socket.socket()\nsrv.bind(('127.0.0.1', 0))\nsrv.listen()\n"
                "port = str(srv.getsockname()[1])\n"
                "subprocess.run([sys.executable, '-c', sys.argv[1], port, '127.0.0.1'])\n",
                CONNECT,
            ]
        )
        assert inside.stdout == "CONNECTED 127.0.0.1\n", inside
        if backend.name == "bwrap":
            # Control: with network=True it shares the host's network and gets through.
            shared = await make_any_sandbox(network=True).exec(
                ["python3", "-c", CONNECT, str(port), "127.0.0.1"]
            )
            assert shared.stdout == "CONNECTED 127.0.0.1\n", shared
            await asyncio.sleep(0.05)
            assert connections == [1]


FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
)


def _docker_processes(sb: DockerSandbox) -> list[list[str]]:
    """``[uid, pid, args]`` of every process in the container, as the engine sees them."""
    return [list(p) for p in sb.container.top(ps_args="-o uid,pid,args")["Processes"]]


async def _settled(read: Callable[[], list[T]], done: Callable[[list[T]], bool]) -> list[T]:
    """`read()` once `done` holds of it, or as it is after 10 s."""
    deadline = time.monotonic() + 10
    while not done(found := await asyncio.to_thread(read)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return found


def _pids_in_use(sb: BwrapSandbox | DockerSandbox) -> tuple[int, int]:
    """The sandbox's process count and its limit, read from outside."""
    if isinstance(sb, DockerSandbox):
        stats = sb.container.stats(stream=False, one_shot=True)["pids_stats"]
        return int(stats["current"]), int(stats["limit"])
    assert sb.cgroup is not None
    pids = sb.cgroup.dirs["pids"]
    return int((pids / "pids.current").read_text()), int((pids / "pids.max").read_text())


async def test_fork_bomb_is_contained_and_others_keep_working(make_any_sandbox, backend):
    bomb = make_any_sandbox(limits=TIGHT)
    other = make_any_sandbox()
    measured_pids = isinstance(bomb, DockerSandbox) or (
        bomb.cgroup_enforced and "pids" in bomb.cgroup.dirs
    )

    async def meanwhile():
        await asyncio.sleep(0.7)  # while the bomb is at its limit
        in_use = await asyncio.to_thread(_pids_in_use, bomb) if measured_pids else None
        calm = await other.exec(
            "for i in 1 2 3 4 5 6 7 8; do (echo $i); done; python3 -c 'print(6*7)'"
        )
        return in_use, calm

    bombed, (in_use, calm) = await asyncio.gather(
        bomb.exec(["python3", "-c", FORK_BOMB], timeout_s=2), meanwhile()
    )
    assert bombed.status is ExecStatus.TIME_LIMIT and bombed.exit_code is None
    assert calm.status is ExecStatus.FINISHED and calm.stdout.split()[-1] == "42"
    if in_use is not None:
        # The pids limit held the bomb at the sandbox's max_processes.
        current, limit = in_use
        assert limit == TIGHT.max_processes and 1 < current <= limit
    # The whole tree was killed at the deadline: what is left is the killed processes'
    # last moments (exiting, or waiting for the container's init to reap them), which a
    # busy machine stretches; wait for those, never for a process that survived.
    if isinstance(bomb, DockerSandbox):
        left = await _settled(lambda: _docker_processes(bomb), lambda ps: len(ps) == 2)
        assert [p[0] for p in left] == [KEEPER_UID, KEEPER_UID], left
    else:
        assert await _settled(lambda: sandbox_processes(bomb.id), lambda ps: not ps) == []
    host = subprocess.run(["sh", "-c", "echo host-ok"], capture_output=True, text=True, check=True)
    assert host.stdout == "host-ok\n"
    again = await bomb.exec("echo alive")  # the bombed sandbox itself recovers
    assert again.stdout == "alive\n", again


async def test_allocation_past_the_memory_limit(make_any_sandbox):
    sb = make_any_sandbox(limits=TIGHT)
    one = await sb.exec(["python3", "-c", "b = bytearray(400 * 1024 * 1024)"])
    assert one.status is ExecStatus.MEMORY_LIMIT
    assert "MemoryError" in one.stderr


async def _oom_kills(sb: BwrapSandbox | DockerSandbox) -> int:
    """How many processes the kernel OOM-killed in the sandbox's memory cgroup."""
    if isinstance(sb, BwrapSandbox):
        assert sb.cgroup is not None
        return sb.cgroup.oom_kills()
    # Inside the container its own cgroup is at the root (v1 or v2 layout).
    read = await sb.exec(
        "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events 2>/dev/null"
    )
    found = re.search(r"^oom_kill (\d+)$", read.stdout, re.MULTILINE)
    assert found, read
    return int(found.group(1))


# Each child stays under the per-process address-space limit; together they do not.
SPREAD = (
    "import os, time\n"
    "for _ in range(4):\n"
    "    if os.fork() == 0:\n"
    "        b = bytearray(90 * 1024 * 1024); time.sleep(1); os._exit(0)\n"
    "for _ in range(4):\n    print(os.waitstatus_to_exitcode(os.wait()[1]))\n"
)


async def test_memory_spread_over_processes_hits_the_sandbox_limit(make_any_sandbox, backend):
    # The limit under test is memory: wall time to spare, since under the suite's load
    # four forks faulting in 90 MB each once took longer than TIGHT's 3 s.
    sb = make_any_sandbox(limits=TIGHT.model_copy(update={"wall_time_s": 30}))
    if isinstance(sb, BwrapSandbox) and not sb.cgroup_enforced:
        pytest.skip("no writable cgroup on this host: memory is bounded per process only")
    before = await _oom_kills(sb)
    other = make_any_sandbox()
    result, calm = await asyncio.gather(
        sb.exec(["python3", "-c", SPREAD]),
        other.exec(["python3", "-c", "print(len(bytes(10**7)))"]),
    )
    assert calm.status is ExecStatus.FINISHED and calm.stdout == "10000000\n"
    assert await _oom_kills(sb) > before  # the sandbox's memory limit, not the host's
    # The kernel killed children (SIGKILL); the parent, ignoring that, exited 0.
    assert "-9" in result.stdout.split() and result.exit_code == 0, result
    if backend.name == "bwrap":
        assert result.status is ExecStatus.MEMORY_LIMIT  # from its cgroup's OOM count
    else:
        # The engine records no OOM kill for exec'd processes: this reads as finished
        # (see the backend's docstring).
        assert result.status is ExecStatus.FINISHED


async def test_loop_forever_hits_wall_time(make_any_sandbox):
    sb = make_any_sandbox(limits=TIGHT)
    result = await sb.exec("sleep 1000", timeout_s=0.5)
    assert result.status is ExecStatus.TIME_LIMIT and result.exit_code is None
    assert 0.5 <= result.duration_s < 3


async def test_busy_loop_hits_cpu_time(make_any_sandbox):
    # Wall time to spare: on a loaded machine 1 s of CPU can take several seconds.
    limits = SandboxLimits(wall_time_s=30, cpu_time_s=1)
    sb = make_any_sandbox(limits=limits)
    result = await sb.exec(["python3", "-c", "while True: pass"])
    assert result.status is ExecStatus.TIME_LIMIT
    assert result.exit_code == 128 + 24  # SIGXCPU: the CPU limit, not the wall clock
    # Both backends round the limit up to whole seconds: SIGXCPU after 1 s of CPU.
    assert 1 <= result.duration_s < limits.wall_time_s


async def test_printing_gigabytes_is_cut_off(make_any_sandbox):
    # A deadline far off: a kill at the cap must not wait for it. The kill itself is an
    # exec of its own on the Docker backend, seconds on a loaded machine, so a deadline
    # of a few seconds cannot tell the two apart.
    limits = TIGHT.model_copy(update={"wall_time_s": 120.0})
    sb = make_any_sandbox(limits=limits)
    result = await sb.exec("head -c 4G /dev/zero | tr '\\0' x")
    assert result.status is ExecStatus.ERROR and result.output_truncated
    assert len(result.stdout) == limits.max_output_bytes
    assert "output limit" in result.stderr
    assert result.duration_s < limits.wall_time_s / 2  # killed at the cap, not the deadline


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_docker_read_file_returns_only_what_the_sandbox_user_may_read(
    make_any_sandbox, backend
):
    # The engine reads as root; a file it reaches that the sandbox user could not read
    # (here put there by the engine itself, as root, mode 0600) is refused.
    import io
    import tarfile

    sb = make_any_sandbox()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode in (("secret", 0o600), ("public", 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid = 3, mode, 0, 0
            tar.addfile(info, io.BytesIO(b"abc"))
    assert sb.container.put_archive("/work", buf.getvalue())
    inside = await sb.exec("cat secret; cat public")
    assert "Permission denied" in inside.stderr and inside.stdout == "abc"
    with pytest.raises(SandboxFileError, match="not readable by the sandbox user"):
        await sb.read_file("secret")
    assert await sb.read_file("public") == b"abc"
