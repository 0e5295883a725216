"""`agentflow serve` as a user runs it: a real process on a loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

AGENTFLOW = [sys.executable, "-m", "trainer.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _server(database_url: str, cwd: Path) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "AGENTFLOW_DATABASE_URL": database_url}
    proc = subprocess.Popen(
        [*AGENTFLOW, "serve", "--port", str(port)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode() if proc.stdout else "exited")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError("server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _client_port(response: httpx.Response) -> int:
    """The local port of the connection a response came on (while it is open)."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


@pytest.fixture(params=["sqlite-default", "postgresql"])
def served_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_database"))
    subprocess.run(
        [*AGENTFLOW, "db", "upgrade"],
        cwd=tmp_path,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "AGENTFLOW_DATABASE_URL"},
    )
    assert (tmp_path / "agentflow.db").exists()  # the default SQLite file
    return f"sqlite+aiosqlite:///{tmp_path / 'agentflow.db'}"


def test_envs_survive_a_restart(served_database: str, tmp_path: Path) -> None:
    name = f"survivor-{os.getpid()}-{time.monotonic_ns()}"
    body = {"name": name, "kind": "python", "spec": {"entry_point": "envs.builtin:X"}}
    with _server(served_database, tmp_path) as url:
        created = httpx.post(f"{url}/v1/envs", json=body)
        assert created.status_code == 201, created.text
        assert httpx.post(f"{url}/v1/envs", json=body).status_code == 409
    with _server(served_database, tmp_path) as url:
        found = httpx.get(f"{url}/v1/envs", params={"name": name}).json()
        assert [e["id"] for e in found["items"]] == [created.json()["id"]]


def test_refuses_a_schema_that_is_behind(tmp_path: Path) -> None:
    env = {**os.environ, "AGENTFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'fresh.db'}"}
    result = subprocess.run(
        [*AGENTFLOW, "serve", "--port", str(_free_port())],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "agentflow db upgrade" in result.stderr


def test_a_public_url_that_misses_the_gateway_is_reported_at_startup(
    sqlite_database: str, tmp_path: Path
) -> None:
    nowhere = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    port = _free_port()
    env = {**os.environ, "AGENTFLOW_DATABASE_URL": sqlite_database, "AGENTFLOW_PUBLIC_URL": nowhere}
    proc = subprocess.Popen(
        [*AGENTFLOW, "serve", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("does not reach this gateway" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        (report,) = [line for line in lines if "does not reach this gateway" in line]
        assert nowhere in report and "ConnectError" in report
        # The gateway still serves; only black-box agents would be stranded.
        assert httpx.get(f"http://127.0.0.1:{port}/livez", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def test_an_idle_connection_outlives_a_stock_clients_pool(
    sqlite_database: str, tmp_path: Path
) -> None:
    """A stock httpx client reuses a pooled connection until its keepalive_expiry, 5 s
    after the previous response. uvicorn's keep-alive timeout was also 5 s, so a request
    sent just as the gateway's timer fired was lost unanswered (httpx.ReadError, nothing
    in the gateway's log; docs/performance.md, "Keep-alive"). The gateway keeps an idle
    connection open past the client's expiry, so the client drops it first."""
    stock_expiry = httpx.Limits().keepalive_expiry
    assert stock_expiry is not None
    # This client's own pool keeps the connection longer, to see whether the gateway
    # closes it: a connection the gateway closed is readable (its FIN), and the pool
    # opens another, from another local port.
    limits = httpx.Limits(keepalive_expiry=stock_expiry + 60)
    with _server(sqlite_database, tmp_path) as url, httpx.Client(limits=limits) as client:
        first = client.get(f"{url}/livez")
        first_port = _client_port(first)
        time.sleep(stock_expiry + 1)
        second = client.get(f"{url}/livez")
        second_port = _client_port(second)
    assert first.status_code == second.status_code == 200
    assert second_port == first_port  # the same connection
