"""16 concurrent browser episodes in a real gateway, then SIGKILL of the gateway and a
restart: no Chromium or Playwright driver process of it is left at any end.

The gateway's processes are told apart from any other browser on the machine by a tag
in their environment (Chromium and the driver inherit the gateway's), read from
`/proc/*/environ`.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest

from agentflow.db import migrate
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port
from tests.support.processes import TAG_ENV, tagged

pytestmark = pytest.mark.integration

LIVE = ("pending", "running")


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.TransportError:
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _episodes(url: str, run_id: str) -> list[dict]:
    page = httpx.get(f"{url}/v1/runs/{run_id}/episodes", params={"limit": 1000}, timeout=30)
    return page.json()["items"]


def test_concurrent_episodes_and_a_gateway_kill_leave_no_browser(
    empty_pg_url: str, tmp_path: Path
) -> None:
    migrate.upgrade(empty_pg_url)
    tag = uuid.uuid4().hex
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    extra = {TAG_ENV: tag, "AGENTFLOW_BROWSER_POOL_SIZE": "2"}
    log = tmp_path / "gateway.log"
    assert tagged(tag) == {}

    with gateway_process(empty_pg_url, tmp_path, port, log=log, **extra) as proc:
        env = httpx.post(
            f"{url}/v1/envs",
            json={
                "name": "click-button",
                "kind": "browser",
                "spec": {"task": "miniwob/click-button-v0", "screenshots": False},
                "max_concurrency": 16,
            },
        )
        assert env.status_code == 201, env.text
        run = httpx.post(
            f"{url}/v1/runs",
            json={
                "name": "browser-processes",
                "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 1024}},
                "envs": [{"id": "click-button", "max_concurrency": 16}],
                "agent": {"max_turns": 4, "max_tokens": 1024, "max_new_tokens": 8},
                "rollout": {"group_size": 4, "max_concurrency": 16},
            },
            timeout=120,
        )
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]

        # 16 episodes live at once, each in its own context of the gateway's browsers.
        _wait(
            lambda: sum(e["status"] == "running" for e in _episodes(url, run_id)) >= 16,
            180,
            "16 running episodes",
        )
        assert tagged(tag), "the gateway's browsers carry the tag"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    # The driver sees its pipe close and takes its browsers with it.
    _wait(lambda: tagged(tag) == {}, 30, "no browser after the SIGKILL")

    with gateway_process(empty_pg_url, tmp_path, port, log=log, **extra) as proc:
        before = {e["id"] for e in _episodes(url, run_id)}
        # The restarted gateway resumes the run: new episodes, browsers again.
        _wait(
            lambda: {e["id"] for e in _episodes(url, run_id) if e["status"] == "running"} - before,
            180,
            "episodes after the restart",
        )
        assert tagged(tag)
        _wait(
            lambda: any(
                e["status"] in ("completed", "truncated") and e["id"] not in before
                for e in _episodes(url, run_id)
            ),
            180,
            "an episode to end after the restart",
        )
        stopped = httpx.post(f"{url}/v1/runs/{run_id}/stop", timeout=120)
        assert stopped.json()["status"] == "stopped", stopped.text
        assert not [e for e in _episodes(url, run_id) if e["status"] in LIVE]
        ended = [e for e in _episodes(url, run_id) if e["status"] in ("completed", "truncated")]
        assert ended, "episodes ran to their end in real Chromium"
    # A clean shutdown closes the shared browser pool.
    _wait(lambda: tagged(tag) == {}, 30, "no browser after shutdown")
