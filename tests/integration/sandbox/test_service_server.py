"""The sandbox service as a real server (``python -m sandbox.service``) on loopback, with
real bwrap sandboxes, driven by the ``HttpSandbox`` client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandbox import ExecStatus, SandboxError
from sandbox.client import HttpSandbox

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _service(args: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``python -m sandbox.service *args`` under ``env``; healthy when entered."""
    port = (env or {}).get("AGENTFLOW_SANDBOX_PORT") or args[args.index("--port") + 1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.service", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
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
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture
def server_url():
    port = _free_port()
    with _service(["--port", str(port), "--pool-size", "1"]):
        yield f"http://127.0.0.1:{port}"


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


async def test_a_service_configured_from_its_environment_requires_its_key():
    # No flags at all: port, pool size, backend and key come from the environment, as in
    # a compose service.
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "AGENTFLOW_SANDBOX_PORT": str(port),
        "AGENTFLOW_SANDBOX_POOL_SIZE": "1",
        "AGENTFLOW_SANDBOX_BACKEND": "bwrap",
        "AGENTFLOW_SANDBOX_API_KEY": "s3cret-key\n",  # as read from a file: the newline goes
    }
    with _service([], env):
        async with httpx.AsyncClient(base_url=url) as http:
            health = await http.get("/health")  # open: a compose healthcheck has no key
            assert health.status_code == 200
            assert health.json()["idle"] == 1 and health.json()["backend"] == "bwrap"
            for headers, said in [
                ({}, "missing API key"),
                ({"Authorization": "Basic czNjcmV0LWtleQ=="}, "missing API key"),
                ({"Authorization": "Bearer s3cret-kez"}, "wrong API key"),
            ]:
                # A body the service would refuse with a 422: the 401 comes first.
                refused = await http.post("/v1/exec", json={"cmd": []}, headers=headers)
                assert refused.status_code == 401, refused.text
                assert refused.json()["detail"].startswith(said)
                assert refused.headers["www-authenticate"] == "Bearer"
            keyed = {"Authorization": "Bearer s3cret-key"}
            bad = await http.post("/v1/exec", json={"cmd": []}, headers=keyed)
            assert bad.status_code == 422  # with the key, the body is checked as before

        sb = HttpSandbox(url, api_key="s3cret-key")
        await sb.write_file("in.txt", "6 7")
        result = await sb.exec("read a b < in.txt; echo $((a * b)) > out.txt; id -u", timeout_s=5)
        assert result.status is ExecStatus.FINISHED and result.stdout == "65534\n"
        assert await sb.read_file("out.txt") == b"42\n"
        await sb.close()

        keyless = HttpSandbox(url, retries=0)
        with pytest.raises(SandboxError, match="401.*missing API key"):
            await keyless.exec("true")
        await keyless.close()


def test_a_bad_setting_in_the_environment_stops_the_service_naming_it():
    for env, said in [
        ({"AGENTFLOW_SANDBOX_PORT": "eighty"}, "argument --port: invalid int value: 'eighty'"),
        ({"AGENTFLOW_SANDBOX_BACKEND": "chroot"}, "AGENTFLOW_SANDBOX_BACKEND='chroot'"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "sandbox.service"],
            cwd=REPO,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
