"""`RetryingTransport` against a real loopback HTTP server that fails as scripted: what is
retried (broken connections, refused connections, attempts that get no answer within their
deadline, 502/503/504), what is not (4xx), the backoff's log lines, and the give-up after
the window, down to the CLI's one line."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentflow.client import AsyncClient, GatewayUnavailable, RetryingTransport, RetryPolicy
from agentflow.errors import InvalidInput, NotFound
from tests.integration.test_serve import _free_port
from tests.unit.test_cli_train import _config
from trainer.cli import app

FAST = RetryPolicy(window_s=10.0, first_wait_s=0.01, max_wait_s=0.05)
DROP = "drop"  # close the connection without an answer
HANG = "hang"  # read the request, then never answer (until the server stops)


Reply = int | str | tuple[int, dict[str, Any]]


class ScriptedGateway:
    """A loopback HTTP/1.1 server; each request gets the next scripted reply (the last one
    repeats): a status code (answered with a JSON body), a status and a body, `DROP` or
    `HANG`."""

    def __init__(self, replies: list[Reply], port: int = 0) -> None:
        self.replies = list(replies)
        self.port = port or _free_port()
        self.requests: list[tuple[str, str, bytes]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # lets the hanging handlers go

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _next(self) -> Reply:
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]

    def start(self) -> None:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                gateway.requests.append((self.command, self.path, body))
                reply = gateway._next()
                if reply == HANG:
                    gateway._stopping.wait()
                if reply in (DROP, HANG):
                    self.close_connection = True
                    return
                status, answer = (
                    reply
                    if isinstance(reply, tuple)
                    else (int(reply), {"detail": f"scripted {reply}", "echo": body.decode()})
                )
                payload = json.dumps(answer)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())

            do_GET = do_POST = _reply

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None and self._thread is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()


@pytest.fixture
def scripted() -> Iterator[list[ScriptedGateway]]:
    """Stops every gateway a test appends."""
    started: list[ScriptedGateway] = []
    yield started
    for gateway in started:
        gateway.stop()


def _gateway(scripted: list[ScriptedGateway], replies: list[Reply]) -> ScriptedGateway:
    gateway = ScriptedGateway(replies)
    gateway.start()
    scripted.append(gateway)
    return gateway


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "agentflow.client" and r.levelno == logging.WARNING
    ]


async def test_broken_connections_and_unavailable_answers_are_retried(
    scripted: list[ScriptedGateway], caplog: pytest.LogCaptureFixture
) -> None:
    gateway = _gateway(scripted, [DROP, 503, 502, 504, 200])
    async with httpx.AsyncClient(base_url=gateway.url, transport=RetryingTransport(FAST)) as http:
        response = await http.post("/v1/runs/r/trajectories/ack", json={"ids": ["a"]})
    assert response.status_code == 200
    assert response.json()["echo"] == '{"ids":["a"]}'
    assert [r[2] for r in gateway.requests] == [b'{"ids":["a"]}'] * 5  # resent as it was
    lines = _retries(caplog)
    assert len(lines) == 4  # one per retry
    call = f"POST {gateway.url}/v1/runs/r/trajectories/ack failed"
    assert all(line.startswith(call) and "retrying in " in line for line in lines), lines
    assert "(attempt 1): RemoteProtocolError" in lines[0]
    assert "(attempt 2): HTTP 503: " in lines[1] and "scripted 503" in lines[1]
    assert "(attempt 4): HTTP 504: " in lines[3]


async def test_a_gateway_that_comes_back_is_waited_for(
    scripted: list[ScriptedGateway], caplog: pytest.LogCaptureFixture
) -> None:
    gateway = ScriptedGateway([200])  # its port refuses connections until it starts
    scripted.append(gateway)
    asyncio.get_running_loop().call_later(0.5, gateway.start)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=gateway.url, transport=RetryingTransport(FAST)) as http:
        response = await http.get("/v1/runs/r", params={"q": 1})
    assert response.status_code == 200 and time.monotonic() - started >= 0.5
    lines = _retries(caplog)
    assert lines and all("ConnectError" in line for line in lines)
    assert f"GET {gateway.url}/v1/runs/r failed (attempt 1)" in lines[0]  # no query string


@pytest.mark.parametrize("status", [400, 401, 404, 409, 422])
async def test_refusals_are_not_retried(
    scripted: list[ScriptedGateway], caplog: pytest.LogCaptureFixture, status: int
) -> None:
    gateway = _gateway(scripted, [status, 200])
    async with httpx.AsyncClient(base_url=gateway.url, transport=RetryingTransport(FAST)) as http:
        response = await http.post("/v1/runs/r/weights", json={"version": 3})
    assert response.status_code == status
    assert len(gateway.requests) == 1 and not _retries(caplog)


async def test_the_api_client_raises_a_refusal_at_once(scripted: list[ScriptedGateway]) -> None:
    gateway = _gateway(scripted, [404, 200])
    transport = RetryingTransport(FAST)
    async with AsyncClient(gateway.url, transport=transport) as api:
        with pytest.raises(NotFound, match="scripted 404"):
            await api.get_run(uuid.uuid4())
    assert len(gateway.requests) == 1


@pytest.mark.parametrize("down", ["refused", "503"])
async def test_past_the_window_the_call_fails_with_one_line(
    scripted: list[ScriptedGateway], caplog: pytest.LogCaptureFixture, down: str
) -> None:
    url = _gateway(scripted, [503]).url if down == "503" else f"http://127.0.0.1:{_free_port()}"
    policy = RetryPolicy(window_s=0.3, first_wait_s=0.02, max_wait_s=0.1)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, transport=RetryingTransport(policy)) as http:
        with pytest.raises(GatewayUnavailable) as raised:
            await http.post("/v1/runs/r/trajectories/lease", json={"max_n": 4})
    assert 0.3 <= time.monotonic() - started < 5
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"the gateway at {url} did not answer for 0.3 s (POST /v1/runs/r/trajectories/lease, "
    )
    last = "HTTP 503: " if down == "503" else "ConnectError"
    assert f"attempts; last error: {last}" in message
    attempts = int(message.split(", ")[1].split()[0])
    assert attempts >= 2 and len(_retries(caplog)) == attempts - 1


@pytest.mark.parametrize("field", ["window_s", "first_wait_s", "max_wait_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_the_policy_refuses_a_window_or_wait_that_is_not_positive(field: str, value: float) -> None:
    with pytest.raises(InvalidInput, match="must be > 0") as refused:
        RetryPolicy(**{field: value})
    assert refused.value.field == (field,)


# Attempts' deadlines that fit the short windows these tests give the trainer.
SHORT_ATTEMPTS = {"attempt_timeout_s": 0.3, "publish_timeout_s": 0.3}


def test_the_trainer_gives_up_on_a_gateway_that_stays_away_with_one_line(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path, {"weights": {"sync": "disk"}, "trainer": {"gateway": SHORT_ATTEMPTS}}
    )
    url = f"http://127.0.0.1:{_free_port()}"
    run_id = str(uuid.uuid4())
    trainer = ["trainer", str(config), "--gateway", url, "--run", run_id]
    result = CliRunner().invoke(app, [*trainer, "--retry-window-s", "0.5"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"error: the gateway at {url} did not answer for 0.5 s (GET /v1/runs/{run_id}, "
    ), result.stderr
    assert "last error: ConnectError" in lines[-1]
    assert all(f"GET {url}/v1/runs/{run_id} failed (attempt " in line for line in lines[:-1])
    assert not (tmp_path / "runs").exists()  # it gave up before training anything


@pytest.mark.parametrize("window", ["0", "-5", "nan"])
def test_the_trainer_refuses_a_window_that_is_not_positive(tmp_path: Path, window: str) -> None:
    config = _config(tmp_path, {"weights": {"sync": "disk"}})
    trainer = ["trainer", str(config), "--gateway", "http://127.0.0.1:9", "--run", "x"]
    result = CliRunner().invoke(app, [*trainer, "--retry-window-s", window])
    assert result.exit_code == 2
    assert "--retry-window-s" in result.output and "must be > 0" in result.output


async def test_an_attempt_that_gets_no_answer_in_time_is_retried(
    scripted: list[ScriptedGateway], caplog: pytest.LogCaptureFixture
) -> None:
    gateway = _gateway(scripted, [HANG, HANG, 200])
    policy = RetryPolicy(window_s=20.0, first_wait_s=0.01, max_wait_s=0.05, attempt_timeout_s=0.3)
    started = time.monotonic()
    async with httpx.AsyncClient(
        base_url=gateway.url, timeout=600, transport=RetryingTransport(policy)
    ) as http:
        response = await asyncio.wait_for(http.post("/v1/runs/r/weights", json={"v": 3}), 15)
    assert response.status_code == 200
    assert 0.6 <= time.monotonic() - started < 10  # two deadlines, not the client's 600 s
    assert [r[2] for r in gateway.requests] == [b'{"v":3}'] * 3  # resent as it was
    lines = _retries(caplog)
    assert len(lines) == 2
    assert all("AttemptTimeout: no answer within 0.3 s; retrying in " in line for line in lines)


async def test_a_gateway_that_hangs_fails_the_call_after_the_window(
    scripted: list[ScriptedGateway],
) -> None:
    gateway = _gateway(scripted, [HANG])
    policy = RetryPolicy(window_s=1.5, first_wait_s=0.01, max_wait_s=0.05, attempt_timeout_s=0.4)
    started = time.monotonic()
    async with AsyncClient(gateway.url, timeout_s=1800, transport=RetryingTransport(policy)) as api:
        with pytest.raises(GatewayUnavailable) as raised:
            await asyncio.wait_for(api.get_run(uuid.uuid4()), 30)
    took = time.monotonic() - started
    # The window opens when the first attempt is sent, and the last one may start at its
    # end: the window plus one deadline at most.
    assert 1.5 <= took < 1.5 + 0.4 + 2.0, took
    message = str(raised.value)
    assert f"the gateway at {gateway.url} did not answer for 1.5 s (GET /v1/runs/" in message
    assert message.endswith("last error: AttemptTimeout: no answer within 0.4 s)"), message
    assert len(gateway.requests) >= 3


@pytest.mark.parametrize("attempt", [1.0, 2.0])
def test_the_policy_refuses_an_attempt_as_long_as_the_window(attempt: float) -> None:
    with pytest.raises(InvalidInput, match="shorter than the retry window") as refused:
        RetryPolicy(window_s=1.0, attempt_timeout_s=attempt)
    assert refused.value.field == ("attempt_timeout_s",)


def test_an_attempt_s_deadline_defaults_inside_the_window() -> None:
    assert RetryPolicy().attempt_s == 60.0
    assert RetryPolicy(window_s=10.0).attempt_s == 5.0
    assert RetryPolicy(window_s=10.0, attempt_timeout_s=9.0).attempt_s == 9.0


@pytest.mark.parametrize(
    ("gateway", "flag"),
    [
        ({"attempt_timeout_s": 300}, []),
        ({"publish_timeout_s": 400}, []),
        ({}, ["--retry-window-s", "100"]),  # the default publish deadline is 240 s
    ],
)
def test_the_trainer_refuses_an_attempt_as_long_as_its_window(
    tmp_path: Path, gateway: dict[str, float], flag: list[str]
) -> None:
    config = _config(tmp_path, {"weights": {"sync": "disk"}, "trainer": {"gateway": gateway}})
    trainer = ["trainer", str(config), "--gateway", "http://127.0.0.1:9", "--run", "x"]
    result = CliRunner().invoke(app, [*trainer, *flag])
    assert result.exit_code == 1, result.output
    assert "trainer.gateway" in result.stderr and "must be shorter than retry_window_s" in (
        result.stderr
    ), result.stderr


def test_the_trainer_gives_up_on_a_gateway_that_hangs_with_one_line(
    tmp_path: Path, scripted: list[ScriptedGateway]
) -> None:
    gateway = _gateway(scripted, [HANG])
    calls = {"retry_window_s": 1.5, "attempt_timeout_s": 0.4, "publish_timeout_s": 0.4}
    config = _config(tmp_path, {"weights": {"sync": "disk"}, "trainer": {"gateway": calls}})
    run_id = str(uuid.uuid4())
    started = time.monotonic()
    result = CliRunner().invoke(
        app, ["trainer", str(config), "--gateway", gateway.url, "--run", run_id]
    )
    assert time.monotonic() - started < 15  # the window, not a client's 30 s timeout
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: the gateway at {gateway.url} did not answer for 1.5 s (GET /v1/runs/{run_id}, "
    ), result.stderr
    assert last.endswith("last error: AttemptTimeout: no answer within 0.4 s)"), last
