"""The desktop state server over a local desktop's shell, without a display: what it
lets through (commands in the home, files under it) and what it refuses (no key, paths
out of the home, malformed requests)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from envs.desktop import state_server
from envs.desktop.local import LocalShell, _Running
from envs.desktop.processes import terminate
from envs.desktop.provider import Desktop
from envs.desktop.state_server import create_app

KEY = "desktop-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
async def home(tmp_path: Path) -> AsyncIterator[tuple[Path, _Running]]:
    folder = tmp_path / "desktop"
    (folder / "home").mkdir(parents=True)
    running = _Running(Desktop("test", "", None), folder)
    yield folder / "home", running
    await terminate(running.procs, grace_s=1)


@pytest.fixture
async def client(home: tuple[Path, _Running]) -> AsyncIterator[httpx.AsyncClient]:
    path, running = home
    env = {"PATH": os.environ["PATH"], "HOME": str(path), "LANG": "C.UTF-8"}
    app = create_app(LocalShell(running, env, path), api_key=KEY)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://desktop") as http:
        yield http


def test_a_keyless_server_is_refused_outside_development() -> None:
    shell = LocalShell(_Running(Desktop("x", "", None), Path("/nonexistent")), {}, Path("/"))
    with pytest.raises(ValueError, match="AGENTFLOW_DESKTOP_API_KEY"):
        create_app(shell, api_key=None)
    with pytest.raises(ValueError, match="API key"):
        create_app(shell, api_key="")
    create_app(shell, api_key=None, development=True)


async def test_every_route_but_health_needs_the_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    body = {"command": "true", "shell": True}
    assert (await client.post("/execute", json=body)).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await client.post("/execute", json=body, headers=wrong)).status_code == 401
    assert (await client.post("/file", data={"file_path": "x"})).status_code == 401
    assert (await client.post("/execute", json=body, headers=AUTH)).status_code == 200


async def test_commands_run_in_the_home(client: httpx.AsyncClient, tmp_path: Path) -> None:
    home = tmp_path / "desktop" / "home"
    shell = {"command": "echo $HOME; pwd; echo oops >&2; exit 3", "shell": True}
    answer = (await client.post("/execute", json=shell, headers=AUTH)).json()
    assert answer == {"status": "error", "output": f"{home}\n{home}\n", "error": "oops\n",
                      "returncode": 3}  # fmt: skip
    # Without a shell a string is argv: nothing is expanded, as in OSWorld's server.
    plain = {"command": "echo '$HOME' two"}
    assert (await client.post("/execute", json=plain, headers=AUTH)).json()["output"] == (
        "$HOME two\n"
    )
    argv = {"command": ["printf", "%s|", "a b", "c"]}
    assert (await client.post("/execute", json=argv, headers=AUTH)).json()["output"] == "a b|c|"
    slow = {"command": "sleep 5", "shell": True, "timeout": 0.2}
    assert (await client.post("/execute", json=slow, headers=AUTH)).json()["returncode"] == 124


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),
        ({"command": ""}, 422),
        ({"command": []}, 422),
        ({"command": "true", "cwd": "/"}, 422),
        ({"command": "true", "timeout": 0}, 422),
        ({"command": 5}, 422),
        ({"command": "echo 'unclosed"}, 400),
        ({"command": "   "}, 400),
    ],
)
async def test_bad_commands_are_refused(
    client: httpx.AsyncClient, body: dict[str, object], status: int
) -> None:
    assert (await client.post("/execute", json=body, headers=AUTH)).status_code == status
    launched = await client.post("/setup/launch", json=body, headers=AUTH)
    assert launched.status_code == (422 if "timeout" in body else status)


async def test_files_round_trip_inside_the_home(client: httpx.AsyncClient, tmp_path: Path) -> None:
    home = tmp_path / "desktop" / "home"
    upload = await client.post("/setup/upload", data={"file_path": "~/docs/a.txt"},
                               files={"file_data": ("a.txt", b"alpha")}, headers=AUTH)  # fmt: skip
    assert upload.status_code == 200
    assert (home / "docs" / "a.txt").read_bytes() == b"alpha"
    for path in ("~/docs/a.txt", "docs/a.txt", f"{home}/docs/a.txt"):
        got = await client.post("/file", data={"file_path": path}, headers=AUTH)
        assert (got.status_code, got.content) == (200, b"alpha"), path
    missing = await client.post("/file", data={"file_path": "~/nope.txt"}, headers=AUTH)
    assert missing.status_code == 404


async def test_paths_out_of_the_home_are_refused(client: httpx.AsyncClient, tmp_path: Path) -> None:
    home = tmp_path / "desktop" / "home"
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    (home / "link").symlink_to(secret)
    for path in ("~/../secret.txt", str(secret), "/etc/passwd", "~/link", "a/../../x", "a\0b"):
        read = await client.post("/file", data={"file_path": path}, headers=AUTH)
        assert read.status_code == 400, path
        wrote = await client.post("/setup/upload", data={"file_path": path},
                                  files={"file_data": ("f", b"x")}, headers=AUTH)  # fmt: skip
        assert wrote.status_code == 400, path
    assert secret.read_text() == "do not read"
    assert not (tmp_path / "x").exists()


async def test_malformed_uploads_and_reads(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "desktop" / "home" / "dir").mkdir()
    no_file = await client.post("/setup/upload", data={"file_path": "a"}, headers=AUTH)
    assert no_file.status_code == 422
    no_path = await client.post("/file", data={}, headers=AUTH)
    assert no_path.status_code == 422
    onto_dir = await client.post("/setup/upload", data={"file_path": "dir"},
                                 files={"file_data": ("f", b"x")}, headers=AUTH)  # fmt: skip
    assert onto_dir.status_code == 400
    monkeypatch.setattr(state_server, "MAX_FILE_BYTES", 4)
    big = await client.post("/setup/upload", data={"file_path": "big"},
                            files={"file_data": ("f", b"12345")}, headers=AUTH)  # fmt: skip
    assert big.status_code == 413


async def test_launch_starts_an_app_in_the_home(client: httpx.AsyncClient, tmp_path: Path) -> None:
    home = tmp_path / "desktop" / "home"
    shell = {"command": "echo launched > started.txt", "shell": True}
    assert (await client.post("/setup/launch", json=shell, headers=AUTH)).status_code == 200
    argv = {"command": ["touch", "argv.txt"]}
    assert (await client.post("/setup/launch", json=argv, headers=AUTH)).status_code == 200
    for _ in range(100):
        if (home / "started.txt").is_file() and (home / "argv.txt").exists():
            break
        await asyncio.sleep(0.02)
    assert (home / "started.txt").read_text() == "launched\n"
    missing = {"command": ["no-such-program-here"]}
    answer = await client.post("/setup/launch", json=missing, headers=AUTH)
    assert answer.status_code == 400 and "no-such-program-here" in answer.json()["detail"]


async def test_health_reports_a_broken_desktop() -> None:
    shell = LocalShell(_Running(Desktop("x", "", None), Path("/nonexistent")), {}, Path("/"))

    async def broken() -> str | None:
        return "exited: x11vnc"

    app = create_app(shell, api_key=KEY, health=broken)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as c:
        answer = await c.get("/health")
    assert answer.status_code == 503 and answer.json()["problem"] == "exited: x11vnc"
