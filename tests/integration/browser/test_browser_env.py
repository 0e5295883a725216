"""BrowserEnv on real Chromium: observations, bad actions, seeding, isolation, limits."""

from __future__ import annotations

import pytest

from envs.base import (
    PNG_SIGNATURE,
    BrowserAction,
    EnvClosed,
    EnvError,
    EpisodeFinished,
    InvalidAction,
    StepTimeout,
    TextAction,
    ToolCall,
    ToolCallsAction,
)
from envs.browser.miniwob import ORIGIN, make_env
from envs.browser.oracles import ORACLES, parse_view
from envs.browser.pool import BrowserPool

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


async def test_observation_contents(pool: BrowserPool) -> None:
    env = make_env("enter-text", pool=pool)
    try:
        first = await env.reset(seed=5)
        obs, info = first.observation, first.info
        assert obs.image is not None and obs.image.startswith(PNG_SIGNATURE)
        assert obs.url == f"{ORIGIN}/miniwob/enter-text.html"
        assert info["goal"] and obs.messages[0].content.startswith(f"Goal: {info['goal']}\n")
        assert obs.text and obs.text in obs.messages[0].content and len(obs.text) <= 600
        assert "Error:" not in obs.messages[0].content
        assert obs.axtree and "textbox" in obs.axtree and "  " in obs.axtree  # indented
        assert info["tabs"] == [{"index": 0, "url": obs.url, "title": "Enter Text Task"}]
        assert info["active_tab"] == 0
        assert info["focused_bid"] is None and info["last_action_error"] is None
        assert (first.reward, first.terminated, first.truncated) == (0.0, False, False)
        box = parse_view(obs).first("textbox")

        focused = await env.step(TextAction(text=f"click('{box.bid}')"))
        assert focused.info["focused_bid"] == box.bid and not focused.done
        assert f"[{box.bid}] textbox (focused)" in (focused.observation.text or "")
        history = [focused.observation]
        done = focused
        while not done.done:
            done = await env.step(ORACLES["enter-text"](history))
            history.append(done.observation)
        assert done.terminated and done.reward == 1.0 and done.info["raw_reward"] > 0
        assert (await env.state())["done"] is True
        with pytest.raises(EpisodeFinished):
            await env.step(TextAction(text="noop()"))
    finally:
        await env.close()


BAD_ACTIONS = {
    "click(": "not a valid action call",
    "__import__('os').system('id')": "no attributes",
    "__import__('os')": "unknown action",
    "page.close()": "no attributes",
    "click('99999')": "no element with bid '99999'",
    "mouse_click(5000, 5)": "off the screen",
    "goto('file:///etc/passwd')": "scheme 'file' is not allowed",
    "goto('http://example.com/')": "host 'example.com' is not allowed",
    "keyboard_press('Hyper')": "unknown key",
    "tab_focus(3)": "no tab 3",
    "fill('1', 'x')": "failed",  # bid 1 is <body>: not a text field
}


async def test_bad_actions_are_shown_and_the_episode_goes_on(pool: BrowserPool) -> None:
    env = make_env("enter-text", pool=pool, action_timeout_ms=300, screenshots=False)
    try:
        history = [(await env.reset(seed=2)).observation]
        for call, message in BAD_ACTIONS.items():
            result = await env.step(BrowserAction(call=call))
            error = result.info["last_action_error"]
            assert error and message in error, (call, error)
            assert f"\nError: {error}" in result.observation.messages[0].content
            assert not result.done and result.reward == 0.0
        with pytest.raises(InvalidAction):
            await env.step(ToolCallsAction(calls=[ToolCall(id="1", name="click")]))
        history = [result.observation]
        while not result.done:  # the oracle still solves it
            result = await env.step(ORACLES["enter-text"](history))
            assert result.info["last_action_error"] is None
            history.append(result.observation)
        assert result.reward == 1.0
    finally:
        await env.close()


async def test_same_seed_same_task_instance(pool: BrowserPool) -> None:
    env = make_env("enter-text", pool=pool, screenshots=False)
    try:
        views = [(await env.reset(seed=seed)).observation.messages[0].content for seed in (7, 7)]
        other = (await env.reset(seed=8)).observation.messages[0].content
        assert views[0] == views[1] and other != views[0]
    finally:
        await env.close()


async def test_each_episode_gets_a_fresh_context(pool: BrowserPool) -> None:
    env = make_env("click-test", pool=pool, screenshots=False, recycle_pages=False)
    try:
        await env.reset(seed=1)
        assert env._lease is not None and env._tabs is not None
        first_context = env._lease.context
        await env._tabs.active.evaluate("() => { localStorage.k = 'v'; document.cookie = 'c=1'; }")
        assert await env._tabs.active.evaluate("() => [localStorage.k, document.cookie]") == [
            "v",
            "c=1",
        ]
        await env.reset(seed=1)
        assert env._lease.context is not first_context
        seen = await env._tabs.active.evaluate("() => [localStorage.k ?? null, document.cookie]")
        assert seen == [None, ""]
    finally:
        await env.close()


async def test_tabs_messages_and_navigation(pool: BrowserPool) -> None:
    env = make_env("click-test", pool=pool, screenshots=False)
    try:
        await env.reset(seed=0)
        result = await env.step(TextAction(text="new_tab()"))
        assert [t["url"] for t in result.info["tabs"]] == [
            f"{ORIGIN}/miniwob/click-test.html",
            "about:blank",
        ]
        assert (
            result.info["tabs"][0]["title"] == "Click Test Task" and result.info["active_tab"] == 1
        )
        result = await env.step(TextAction(text="tab_focus(0)"))
        assert result.info["active_tab"] == 0 and result.info["last_action_error"] is None
        result = await env.step(TextAction(text="send_msg_to_user('hello')"))
        assert result.info["messages_to_user"] == ["hello"]
        result = await env.step(TextAction(text=f"goto('{ORIGIN}/miniwob/click-button.html')"))
        assert result.info["last_action_error"] is None
        assert result.terminated and result.reward == 0.0  # navigating away ends it at 0
    finally:
        await env.close()


async def test_step_timeout_and_close(pool: BrowserPool) -> None:
    env = make_env("click-test", pool=pool, screenshots=False)
    await env.reset(seed=0)
    with pytest.raises(StepTimeout):
        await env.step(TextAction(text="noop(3000)"), timeout_s=0.3)
    await env.close()
    await env.close()  # idempotent
    with pytest.raises(EnvClosed):
        await env.step(TextAction(text="noop()"))
    with pytest.raises(EnvClosed):
        await env.reset()


async def test_a_crashed_browser_is_replaced() -> None:
    own = BrowserPool(1, spares=0, idle_close_s=None)
    env = make_env("click-test", pool=own, screenshots=False)
    try:
        await env.reset(seed=0)
        browser = own._slots[0].browser
        assert browser is not None and own.launches == 1
        session = await browser.new_browser_cdp_session()
        with pytest.raises(Exception):  # noqa: B017 - the crash cuts the answer off
            await session.send("Browser.crash")
        with pytest.raises(EnvError, match="browser"):
            await env.step(TextAction(text="noop()"))
        result = await env.reset(seed=0)
        assert own.launches == 2 and not result.done
    finally:
        await env.close()
        await own.aclose()
