"""Desktop episodes end to end: a local desktop, its noVNC page in Chromium, the
oracle's actions on the canvas, the checker reading the desktop's home."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from envs.base import (
    PNG_SIGNATURE,
    BrowserAction,
    ComputerAction,
    InvalidAction,
    StepResult,
    StepTimeout,
    TextAction,
)
from envs.desktop.env import DesktopEnv
from envs.desktop.local import LocalDesktopProvider
from envs.desktop.novnc import ChromiumHost
from envs.desktop.tasks import TASKS, TERMINAL_POINT, oracle

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
SCREEN = (1024, 768)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def host() -> AsyncIterator[ChromiumHost]:
    host = ChromiumHost()
    yield host
    await host.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def provider(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalDesktopProvider]:
    provider = LocalDesktopProvider(runtime_dir=Path(tmp_path_factory.mktemp("desktops")))
    yield provider
    await provider.aclose()


def make(task: str, provider: LocalDesktopProvider, host: ChromiumHost, **kw: object) -> DesktopEnv:
    return DesktopEnv(TASKS[task], provider=provider, host=host, screen=SCREEN, **kw)  # type: ignore[arg-type]


def act(action_type: str, **parameters: object) -> ComputerAction:
    return ComputerAction(action_type=action_type, parameters=parameters)  # type: ignore[arg-type]


async def test_oracle_solves_terminal_echo(
    provider: LocalDesktopProvider, host: ChromiumHost
) -> None:
    env = make("terminal-echo", provider, host)
    started = time.monotonic()
    result = await env.reset(seed=2)
    reset_s = time.monotonic() - started
    first = result.observation
    assert first.image is not None and first.image.startswith(PNG_SIGNATURE)
    assert first.url is not None and first.url.startswith("http://127.0.0.1:")
    assert "Instruction: In the terminal, write the word 'river'" in first.messages[0].content
    assert result.info["screen"] == list(SCREEN)
    desktop = env.desktop
    assert desktop is not None and desktop.home is not None
    observations, steps_s = [first], []
    while not result.terminated:
        started = time.monotonic()
        result = await env.step(oracle(observations), timeout_s=30)
        steps_s.append(time.monotonic() - started)
        assert result.info["last_action_error"] is None
        observations.append(result.observation)
    assert result.reward == 1.0 and result.info["passed"]
    assert (desktop.home / "note.txt").read_text() == "river\n"
    assert first.image != result.observation.image  # the screen shows what was typed
    print(f"\nreset {reset_s:.2f} s, steps {', '.join(f'{s:.2f}' for s in steps_s)} s")
    await env.close()
    await env.close()  # idempotent
    assert desktop.id not in [d.id for d in provider.running]


async def test_wrong_actions_fail(provider: LocalDesktopProvider, host: ChromiumHost) -> None:
    env = make("window-title", provider, host)
    try:
        result = await env.reset(seed=0)
        assert "titled 'Notes'" in result.info["instruction"]
        await env.step(act("CLICK", x=TERMINAL_POINT[0], y=TERMINAL_POINT[1]))
        await env.step(act("TYPING", text="xterm -T Wrong &"))
        await env.step(act("PRESS", key="enter"))
        result = await env.step(act("DONE"))
        assert result.terminated and result.reward == 0.0
        assert "Wrong" in (result.info["checks"][1]["value"] or "")
    finally:
        await env.close()


async def test_invalid_actions_come_back_as_errors(
    provider: LocalDesktopProvider, host: ChromiumHost
) -> None:
    env = make("make-directory", provider, host, wait_s=2.0)
    try:
        await env.reset(seed=1)
        bad: list[tuple[object, str]] = [
            (act("CLICK", x=SCREEN[0], y=5), "x=1024 is outside 0..1023"),
            (act("PRESS", key="hyperspace"), "unknown key"),
            (act("MOVE_TO", x=1, y=2, z=3), "unknown parameter"),
            (TextAction(text="please click the terminal"), "not a JSON computer action"),
        ]
        for action, error in bad:
            result = await env.step(action)  # type: ignore[arg-type]
            assert not result.terminated
            assert error in result.info["last_action_error"]
            assert (
                f"Error: {result.info['last_action_error']}"
                in result.observation.messages[0].content
            )
            assert result.observation.image is not None
        reply = '```json\n{"action_type": "MOVE_TO", "parameters": {"x": 30, "y": 40}}\n```'
        result = await env.step(TextAction(text=reply))
        assert result.info["last_action_error"] is None and result.info["pointer"] == [30, 40]
        with pytest.raises(InvalidAction):
            await env.step(BrowserAction(call="click('1')"))
        with pytest.raises(StepTimeout):
            await env.step(act("WAIT"), timeout_s=0.3)
        result = await env.step(act("FAIL"))  # a feasible task fails on FAIL
        assert result.terminated and result.reward == 0.0
    finally:
        await env.close()


async def test_infeasible_task_passes_only_on_fail_and_resets(
    provider: LocalDesktopProvider, host: ChromiumHost
) -> None:
    env = make("infeasible-photoshop", provider, host)
    try:
        outcomes: list[StepResult] = []
        for last in ("DONE", "FAIL"):  # two episodes of one env, each on a fresh desktop
            await env.reset()
            outcomes.append(await env.step(act(last)))
        assert [r.reward for r in outcomes] == [0.0, 1.0]
    finally:
        await env.close()
