"""Recycled MiniWoB++ pages on real Chromium: the next episode in the last one's page
reads exactly as it would in a freshly loaded one, and a page that cannot be put back
is closed instead."""

from __future__ import annotations

import re

import pytest

from envs.base import Observation, StepResult, TextAction
from envs.browser.env import BrowserEnv
from envs.browser.miniwob import make_env
from envs.browser.oracles import ORACLES, noisy_oracle
from envs.browser.pool import BrowserPool

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

# The HUD's countdown ticks each second; everything else must match to the character.
_COUNTDOWN = re.compile(r"'\d+ / \d+sec'")


def _reading(result: StepResult) -> tuple[str, str, str]:
    observation = result.observation
    content = observation.messages[0].content
    assert isinstance(content, str) and observation.axtree is not None
    return content, _COUNTDOWN.sub("'T'", observation.axtree), observation.url or ""


async def _play_noisily(env: BrowserEnv, task: str, seed: int) -> None:
    """An episode that leaves the page in some state: a noisy player's clicks and typing,
    finished or not."""
    policy = noisy_oracle(0.5, seed, oracle=ORACLES[task])
    result = await env.reset(seed=seed)
    history: list[Observation] = [result.observation]
    for _ in range(3):
        if result.done:
            break
        result = await env.step(policy(history))
        history.append(result.observation)


@pytest.mark.parametrize("task", sorted(ORACLES))
async def test_a_recycled_page_reads_as_a_fresh_one(pool: BrowserPool, task: str) -> None:
    recycled = make_env(task, pool=pool, screenshots=False)
    fresh = make_env(task, pool=pool, screenshots=False, recycle_pages=False)
    try:
        await _play_noisily(recycled, task, seed=11)
        assert recycled._lease is not None
        page = recycled._lease.page
        await pool.settle()  # an earlier test's recycles, still running, count before this one
        before = pool.recycled
        await recycled._end_episode(wait=True)
        await pool.settle()  # the recycle runs in the background; the reset takes its page
        again = await recycled.reset(seed=12)
        assert pool.recycled == before + 1 and recycled._lease.page is page
        loaded = await fresh.reset(seed=12)
        assert _reading(again) == _reading(loaded)
        assert again.info["focused_bid"] == loaded.info["focused_bid"]  # a dialog's own focus
        assert again.info["last_action_error"] is None
    finally:
        await recycled.close()
        await fresh.close()


async def test_storage_and_cookies_do_not_survive_a_recycle(pool: BrowserPool) -> None:
    env = make_env("click-test", pool=pool, screenshots=False)
    try:
        await env.reset(seed=1)
        assert env._tabs is not None
        await env._tabs.active.evaluate("() => { localStorage.k = 'v'; document.cookie = 'c=1'; }")
        context = env._lease.context if env._lease else None
        await env._end_episode(wait=True)
        await pool.settle()
        await env.reset(seed=1)
        assert env._lease is not None and env._lease.context is context  # recycled
        seen = await env._tabs.active.evaluate("() => [localStorage.k ?? null, document.cookie]")
        assert seen == [None, ""]
    finally:
        await env.close()


@pytest.mark.parametrize(
    "leave",
    ["new_tab()", "goto('http://miniwob.local/miniwob/click-button.html')"],
)
async def test_a_page_left_in_another_state_is_closed_not_recycled(
    pool: BrowserPool, leave: str
) -> None:
    env = make_env("click-test", pool=pool, screenshots=False)
    try:
        await env.reset(seed=0)
        assert env._lease is not None
        context = env._lease.context
        result = await env.step(TextAction(text=leave))
        assert result.info["last_action_error"] is None
        before = pool.recycled
        result = await env.reset(seed=0)
        assert pool.recycled == before and env._lease.context is not context
        assert [t["url"] for t in result.info["tabs"]] == [
            "http://miniwob.local/miniwob/click-test.html"
        ]
    finally:
        await env.close()
