"""The sandbox service as a real server (``python -m sandbox.service``) on loopback, with
real bwrap sandboxes, driven by the ``HttpSandbox`` client."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandbox import ExecStatus
from sandbox.client import HttpSandbox

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_url():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.service", "--port", str(port), "--pool-size", "1"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read() if proc.stderr else b""
                raise RuntimeError(f"service did not start: {err!r}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


async def test_real_server_runs_commands_in_bwrap(server_url):
    sb = HttpSandbox(server_url)
    await sb.write_file("calc.py", "print(sum(range(10)))")
    result = await sb.exec("python3 calc.py > answer.txt; id -u; ls /root", timeout_s=5)
    assert result.status is ExecStatus.FINISHED
    assert result.stdout == "65534\n" and "No such file" in result.stderr
    assert await sb.read_file("answer.txt") == b"45\n"
    slow, bad = await asyncio.gather(
        sb.exec("sleep 30", timeout_s=0.5), sb.exec([]), return_exceptions=True
    )
    assert not isinstance(slow, BaseException) and slow.status is ExecStatus.TIME_LIMIT
    assert isinstance(bad, ValueError)
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{server_url}/health")).json()
    assert health["status"] == "ok" and health["backend"] == "bwrap"
    await sb.close()
