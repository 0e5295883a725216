"""The sandbox service and its client, in process (ASGI transport) over an in-memory
sandbox; the real-bwrap, real-server test is in tests/integration/sandbox."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import httpx
import pytest

from sandbox import ExecStatus, SandboxError, SandboxFileError, SandboxLimits
from sandbox.client import HttpSandbox
from sandbox.service import RequireApiKey, create_app

from .memory_sandbox import MemorySandbox


@pytest.fixture
async def service() -> AsyncIterator[tuple[httpx.ASGITransport, list[MemorySandbox]]]:
    made: list[MemorySandbox] = []

    def factory(limits: SandboxLimits) -> MemorySandbox:
        made.append(MemorySandbox(limits))
        return made[-1]

    app = create_app(factory, pool_size=1, max_active=4)
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app), made


async def _post(transport, body) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        return await http.post("/v1/exec", json=body)


async def test_exec_runs_in_a_one_shot_sandbox_with_files(service):
    transport, made = service
    resp = await _post(
        transport,
        {
            "cmd": ["cat", "a.txt", "b.bin"],
            "files": {"a.txt": "hi "},
            "files_b64": {"b.bin": base64.b64encode(b"there").decode()},
            "return_files": True,
            "timeout_s": 3,
            "env": {"X": "1"},
            "cwd": "sub",
        },
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["stdout"] == "hi there" and body["status"] == "finished"
    assert body["files"] == {
        "a.txt": base64.b64encode(b"hi ").decode(),
        "b.bin": base64.b64encode(b"there").decode(),
    }
    used = next(sb for sb in made if sb.execs)
    assert used.closed  # one-shot
    assert used.execs[0]["timeout_s"] == 3 and used.execs[0]["cwd"] == "sub"


@pytest.mark.parametrize(
    "body",
    [
        {"cmd": []},
        {"cmd": ""},
        {"cmd": "x", "files": {"../escape": "x"}},
        {"cmd": "x", "files": {"/etc/passwd": "x"}},
        {"cmd": "x", "files_b64": {"a": "not base64!"}},
        {"cmd": "x", "timeout_s": 0},
        {"cmd": "x", "env": {"BAD NAME": "1"}},
        {"cmd": "x", "cwd": "../.."},
        {"cmd": "x", "surprise": 1},
        {"cmd": "x", "limits": {"memory_mb": 1}},
        {"cmd": "x", "limits": {"memory_mb": 60000}},  # valid, but above the service maximum
    ],
)
async def test_bad_input_is_422(service, body):
    transport, _ = service
    assert (await _post(transport, body)).status_code == 422


async def test_a_failing_sandbox_fails_only_its_request(service):
    transport, _ = service
    assert (await _post(transport, {"cmd": "explode"})).status_code == 503
    ok = await _post(transport, {"cmd": "echo fine"})
    assert ok.status_code == 200 and ok.json()["stdout"] == "echo fine"


async def test_own_limits_get_a_fresh_sandbox(service):
    transport, made = service
    limits = {"wall_time_s": 2, "memory_mb": 64}
    assert (await _post(transport, {"cmd": "echo x", "limits": limits})).status_code == 200
    custom = [sb for sb in made if sb.limits != SandboxLimits()]
    assert len(custom) == 1 and custom[0].limits == SandboxLimits(**limits) and custom[0].closed


async def test_health(service):
    transport, _ = service
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        body = (await http.get("/health")).json()
    assert body["status"] == "ok" and body["idle"] == 1


async def test_client_carries_the_work_dir_between_execs(service):
    transport, _ = service
    sb = HttpSandbox("http://svc", transport=transport)
    await sb.write_file("in.txt", "data")
    result = await sb.exec(["write", "out.txt", "made"])
    assert result.status is ExecStatus.FINISHED
    assert await sb.read_file("out.txt") == b"made"
    assert (await sb.exec(["cat", "in.txt", "out.txt"])).stdout == "datamade"
    with pytest.raises(SandboxFileError):
        await sb.read_file("missing")
    with pytest.raises(ValueError):
        await sb.exec([])
    await sb.close()
    await sb.close()


async def test_client_retries_transient_errors_then_gives_up():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, text="busy")
        if len(calls) == 2:
            return httpx.Response(
                200,
                json={
                    "stdout": "ok",
                    "stderr": "",
                    "exit_code": 0,
                    "status": "finished",
                    "duration_s": 0.1,
                    "output_truncated": False,
                    "files": {},
                },
            )
        return httpx.Response(500, text="boom")

    sb = HttpSandbox("http://svc", transport=httpx.MockTransport(handler), retries=1)
    assert (await sb.exec("x")).stdout == "ok" and len(calls) == 2
    with pytest.raises(SandboxError, match="500"):
        await sb.exec("x")
    assert len(calls) == 3  # a 500 is not retried
    await sb.close()


KEY = "k3y-ünïcode"  # non-ASCII: the check compares the header's raw bytes with the UTF-8 key


@pytest.fixture
async def keyed_service() -> AsyncIterator[tuple[httpx.ASGITransport, list[MemorySandbox]]]:
    made: list[MemorySandbox] = []

    def factory(limits: SandboxLimits) -> MemorySandbox:
        made.append(MemorySandbox(limits))
        return made[-1]

    app = create_app(factory, pool_size=1, max_active=4, api_key=KEY)
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app), made


@pytest.mark.parametrize(
    ("authorization", "said"),
    [
        (None, "missing API key"),
        (b"Bearer", "missing API key"),
        (b"Bearer   ", "missing API key"),
        (b"Token " + KEY.encode(), "missing API key"),
        (b"Bearer " + KEY.encode()[:-1], "wrong API key"),
        (b"Bearer " + KEY.encode("latin-1", "replace"), "wrong API key"),
    ],
)
async def test_a_keyed_service_refuses_requests_without_its_key(keyed_service, authorization, said):
    transport, made = keyed_service
    headers = [(b"authorization", authorization)] if authorization is not None else []
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        for method, path, body in [
            ("POST", "/v1/exec", {"cmd": "echo hi"}),
            ("POST", "/v1/exec", {"cmd": [], "surprise": 1}),  # a 422 with the key
            ("POST", "/v1/exec", None),  # no body at all
            ("GET", "/openapi.json", None),  # the schema is not given away either
            ("GET", "/no/such/route", None),  # nor which routes exist
            ("POST", "/health", None),  # only GET /health is open
        ]:
            resp = await http.request(method, path, json=body, headers=headers)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.json() == {"detail": resp.json()["detail"]}
            assert resp.json()["detail"].startswith(said)
            assert resp.headers["www-authenticate"] == "Bearer"
    assert not any(sb.execs for sb in made)  # nothing ran


async def test_a_keyed_service_serves_its_key_and_keeps_health_open(keyed_service):
    transport, _ = keyed_service
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        keyed = [(b"authorization", b"bearer  " + KEY.encode() + b" ")]  # scheme in any case
        bad = await http.post("/v1/exec", json={"cmd": []}, headers=keyed)
        assert bad.status_code == 422  # with the key, the body is checked as before
        ok = await http.post("/v1/exec", json={"cmd": "echo hi"}, headers=keyed)
        assert ok.status_code == 200 and ok.json()["stdout"] == "echo hi"
    sb = HttpSandbox("http://svc", transport=transport, api_key="right-key")
    with pytest.raises(SandboxError, match="401"):
        await sb.exec("echo hi")  # the client's key is sent, and this one is wrong
    await sb.close()


async def test_the_client_sends_its_key():
    app = create_app(lambda limits: MemorySandbox(limits), pool_size=1, api_key="abc123")
    async with app.router.lifespan_context(app):
        sb = HttpSandbox("http://svc", transport=httpx.ASGITransport(app=app), api_key="abc123")
        await sb.write_file("a.txt", "x")
        assert (await sb.exec(["cat", "a.txt"])).stdout == "x"
        await sb.close()


@pytest.mark.parametrize("key", ["", " padded", "padded\n"])
def test_an_api_key_that_could_never_match_is_refused(key):
    with pytest.raises(ValueError, match="API key"):
        RequireApiKey(create_app(lambda limits: MemorySandbox(limits)), key)


async def test_no_key_leaves_the_service_open():
    # An empty key is no key (the CLI maps an empty AGENTFLOW_SANDBOX_API_KEY to None).
    for key in (None, ""):
        app = create_app(lambda limits: MemorySandbox(limits), pool_size=1, api_key=key)
        async with app.router.lifespan_context(app):
            resp = await _post(httpx.ASGITransport(app=app), {"cmd": "echo open"})
        assert resp.status_code == 200 and resp.json()["stdout"] == "echo open"


def test_an_image_is_for_the_docker_backend_only(monkeypatch, capsys):
    from sandbox.service import main

    with pytest.raises(ValueError, match="docker backend"):
        create_app(backend="bwrap", image="agentflow-sandbox-runtime:local")
    monkeypatch.setenv("AGENTFLOW_SANDBOX_IMAGE", "agentflow-sandbox-runtime:local")
    with pytest.raises(SystemExit) as exited:
        main(["--backend", "bwrap"])
    assert exited.value.code == 2
    assert "AGENTFLOW_SANDBOX_IMAGE" in capsys.readouterr().err
