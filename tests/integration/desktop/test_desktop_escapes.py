"""The sandbox's escape probes, typed into a local desktop's terminal through the env's
own actions (a click on the terminal, then the command typed on the noVNC canvas), as a
policy in training would: every one is contained, and the episode then ends normally.

The probes (secrets, sockets, devices, other processes, writing outside, filling the
disk, forking past the process cap) are a Python script the test puts in the desktop's
home, as a task's setup puts files there; the shell that runs it is the terminal's.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from envs.base import ComputerAction
from envs.desktop.env import DesktopEnv
from envs.desktop.local import LocalDesktopProvider
from envs.desktop.novnc import ChromiumHost
from envs.desktop.sandboxed import DesktopLimits
from envs.desktop.tasks import TASKS, TERMINAL_POINT
from tests.integration.desktop.conftest import under, wait_until_gone

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

LIMITS = DesktopLimits(memory_mb=768, max_processes=48, home_mb=8, tmp_mb=8, max_file_mb=32)
SECRET_ENV = "AGENTFLOW_TEST_DESKTOP_SECRET"

PROBES = r"""
import errno, json, os, socket, subprocess, sys, time
args = json.loads(sys.argv[1])
found = {}

def attempt(name, fn):
    try:
        found[name] = ["ok", fn()]
    except OSError as exc:
        found[name] = [errno.errorcode.get(exc.errno, str(exc.errno)), str(exc)]
    except Exception as exc:
        found[name] = [type(exc).__name__, str(exc)]

def read(path):
    with open(path, "rb") as f:
        return f.read(200).decode(errors="replace")

def connect_tcp(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"

def connect_unix(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(path)
        return "connected"

def write(path):
    with open(path, "w") as f:
        f.write("pwned")
    return "written"

def fill(path):
    written = 0
    try:
        with open(path, "wb", buffering=0) as f:
            while written < 64 << 20:
                written += f.write(bytes(1 << 20))
    except OSError as exc:
        return [errno.errorcode[exc.errno], written]
    return ["no error", written]

def fork_many(n):
    children, refused = [], None
    for _ in range(n):
        try:
            children.append(subprocess.Popen(["sleep", "30"]))
        except OSError as exc:
            refused = errno.errorcode[exc.errno]
            break
    started = len(children)
    for child in children:
        child.kill()
        child.wait()
    return [started, refused]

attempt("uid", lambda: read("/proc/self/status").split("Uid:")[1].split()[0])
attempt("cap_eff", lambda: [l for l in open("/proc/self/status") if l.startswith("CapEff")][0])
attempt("secret_file", lambda: read(args["secret_file"]))
attempt("secret_env", lambda: os.environ.get(args["secret_env"], "absent"))
attempt("pid1_environ", lambda: read("/proc/1/environ"))
attempt("shadow", lambda: read("/etc/shadow"))
attempt("root_home", lambda: os.listdir("/root"))
attempt("gateway_listener", lambda: connect_tcp(args["listener_port"]))
attempt("postgres", lambda: connect_tcp(5432))
attempt("postgres_socket", lambda: connect_unix("/var/run/postgresql/.s.PGSQL.5432"))
attempt("host_unix_socket", lambda: connect_unix(args["unix_socket"]))
attempt("docker_socket", lambda: connect_unix("/var/run/docker.sock"))
attempt("devices", lambda: sorted(os.listdir("/dev")))
attempt("block_device", lambda: read("/dev/vda"))
attempt("host_pid_visible", lambda: os.path.exists(f"/proc/{args['host_pid']}/cmdline")
        and read(f"/proc/{args['host_pid']}/cmdline"))
attempt("processes", lambda: sorted(
    read(f"/proc/{p}/comm").strip() for p in os.listdir("/proc") if p.isdigit()))
attempt("kill_host", lambda: os.kill(args["host_pid"], 9) or "killed")
attempt("write_usr", lambda: write("/usr/pwned"))
attempt("write_etc", lambda: write("/etc/pwned"))
attempt("fill_home", lambda: fill(os.path.expanduser("~/fill.bin")))
os.remove(os.path.expanduser("~/fill.bin"))
attempt("fill_tmp", lambda: fill("/tmp/fill.bin"))
os.remove("/tmp/fill.bin")
attempt("fork_past_cap", lambda: fork_many(args["forks"]))
attempt("network_interfaces", lambda: sorted(name for _, name in socket.if_nameindex()))
with open("probes.tmp", "w") as f:
    json.dump(found, f)
os.rename("probes.tmp", "probes.json")
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def host() -> AsyncIterator[ChromiumHost]:
    host = ChromiumHost()
    yield host
    await host.aclose()


def act(action_type: str, **parameters: object) -> ComputerAction:
    return ComputerAction(action_type=action_type, parameters=parameters)  # type: ignore[arg-type]


async def test_escape_probes_typed_into_the_terminal_are_contained(
    runtime_dir: Path, host: ChromiumHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    secret_file = tmp_path / "api-key.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o644)  # readable by anyone on the host: only the sandbox stops it
    monkeypatch.setenv(SECRET_ENV, secret)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    unix_path = Path("/tmp") / f"agentflow-test-{uuid.uuid4().hex[:8]}.sock"
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(str(unix_path))
    unix_listener.listen()
    os.chmod(unix_path, 0o777)
    provider = LocalDesktopProvider(runtime_dir=runtime_dir, limits=LIMITS)
    env = DesktopEnv(TASKS["terminal-echo"], provider=provider, host=host, screen=(800, 600))
    try:
        await env.reset(seed=0)
        desktop = env.desktop
        assert desktop is not None and desktop.shell is not None and desktop.home is not None
        args = {
            "secret_file": str(secret_file),
            "secret_env": SECRET_ENV,
            "listener_port": listener.getsockname()[1],
            "unix_socket": str(unix_path),
            "host_pid": os.getpid(),
            "forks": LIMITS.max_processes + 16,
        }
        await desktop.shell.write_file("probes.py", PROBES.encode())
        await desktop.shell.write_file("args.json", json.dumps(args).encode())
        await env.step(act("CLICK", x=TERMINAL_POINT[0], y=TERMINAL_POINT[1]), timeout_s=30)
        typed = 'python3 probes.py "$(cat args.json)" 2> probes.err\n'
        await env.step(act("TYPING", text=typed), timeout_s=30)
        for _ in range(600):
            if (report := await desktop.shell.read_file("probes.json")) is not None:
                break
            await asyncio.sleep(0.1)
        else:
            errors = await desktop.shell.read_file("probes.err")
            pytest.fail(f"the probes did not finish: {errors!r}")
        found = json.loads(report)

        assert found["uid"] == ["ok", "65534"]
        assert found["cap_eff"][1].split()[1] == "0000000000000000"
        assert found["secret_file"][0] == "ENOENT"  # the host's files are not there at all
        assert found["secret_env"] == ["ok", "absent"]
        assert secret not in json.dumps(found)  # not in /proc/1's environment either
        assert found["shadow"][0] == "ENOENT" and found["root_home"][0] == "ENOENT"
        # No network but the sandbox's own loopback: the host's listeners are unreachable.
        assert found["gateway_listener"][0] == "ECONNREFUSED"
        assert found["postgres"][0] == "ECONNREFUSED"
        assert found["postgres_socket"][0] == "ENOENT"
        assert found["host_unix_socket"][0] == "ENOENT"
        assert found["docker_socket"][0] == "ENOENT"
        assert found["network_interfaces"] == ["ok", ["lo"]]
        assert found["block_device"][0] == "ENOENT"
        assert "vda" not in found["devices"][1] and "mem" not in found["devices"][1]
        assert found["host_pid_visible"] == ["ok", False]
        assert "pytest" not in json.dumps(found["processes"])
        assert {"Xvfb", "xterm", "x11vnc"} <= set(found["processes"][1])
        assert found["kill_host"][0] == "ESRCH"  # no such process in its pid namespace
        assert found["write_usr"][0] == "EROFS" and found["write_etc"][0] == "EROFS"
        code, written = found["fill_home"][1]
        assert code == "ENOSPC" and written <= LIMITS.home_mb << 20
        code, written = found["fill_tmp"][1]
        assert code == "ENOSPC" and written <= LIMITS.tmp_mb << 20
        started, refused = found["fork_past_cap"][1]
        assert refused == "EAGAIN" and started < LIMITS.max_processes

        # From the host: nothing reached it, and the desktop still works.
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert secret_file.read_text() == secret
        echo = await desktop.shell.run("echo alive")
        assert echo.stdout == "alive\n"
        assert provider.exited(desktop) == []
        # And the episode ends normally: the task done in the same terminal, then DONE.
        word = TASKS["terminal-echo"].fields(0)["word"]
        await env.step(act("TYPING", text=f"echo {word} > ~/note.txt\n"), timeout_s=30)
        done = await env.step(act("DONE"), timeout_s=30)
        assert done.terminated and done.reward == 1.0 and done.info["passed"]
    finally:
        await env.close()
        await provider.aclose()
        listener.close()
        unix_listener.close()
        unix_path.unlink(missing_ok=True)
    await wait_until_gone(lambda: under(runtime_dir))
