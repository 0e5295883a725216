"""The browser pool's processes: started lazily, bounded, closed on aclose, when idle,
with the shared pool, and when the process that drives them is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from envs import registry
from envs.browser.chromium import CHROMIUM_ARGS, chromium_executable
from envs.browser.miniwob import make_env
from envs.browser.pool import BrowserPool, shared_pool
from tests.integration.browser.conftest import alive, chromium_descendants

pytestmark = pytest.mark.integration


async def _gone(pids: set[int], within_s: float = 10.0) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


async def test_aclose_ends_every_browser() -> None:
    before = chromium_descendants()
    pool = BrowserPool(2, idle_close_s=None)
    assert pool.browsers_running == 0  # nothing starts before the first lease
    envs = [make_env("click-test", pool=pool, screenshots=False) for _ in range(3)]
    await asyncio.gather(*(env.reset(seed=i) for i, env in enumerate(envs)))
    assert pool.browsers_running == 2
    started = chromium_descendants() - before
    assert len(started) >= 2
    for env in envs:
        await env.close()
    await pool.aclose()
    await pool.aclose()  # idempotent
    assert await _gone(started) == set()
    assert chromium_descendants() <= before


async def test_a_pool_on_a_shared_driver_leaves_the_driver_running() -> None:
    from playwright.async_api import async_playwright

    driver = await async_playwright().start()
    try:
        for seed in range(2):  # a browser per episode from one driver: the bench's cold path
            pool = BrowserPool(1, spares=0, idle_close_s=None, playwright=driver)
            env = make_env("click-test", pool=pool, screenshots=False)
            assert not (await env.reset(seed=seed)).done
            await env.close()
            await pool.aclose()
            assert pool.browsers_running == 0 and pool.launches == 1
        browser = await driver.chromium.launch(  # the driver still answers
            executable_path=chromium_executable(headless=True), args=list(CHROMIUM_ARGS)
        )
        await browser.close()
    finally:
        await driver.stop()


async def test_idle_pool_closes_its_browsers_and_starts_again() -> None:
    pool = BrowserPool(1, idle_close_s=0.2)
    env = make_env("click-test", pool=pool, screenshots=False)
    try:
        before = chromium_descendants()
        await env.reset(seed=0)
        started = chromium_descendants() - before
        await env.close()
        assert await _gone(started) == set()
        # Its processes can end before the pool's close of the browser returns to it.
        deadline = time.monotonic() + 10
        while pool.browsers_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pool.browsers_running == 0
        again = make_env("click-test", pool=pool, screenshots=False)
        result = await again.reset(seed=0)
        assert pool.launches == 2 and not result.done
        await again.close()
    finally:
        await pool.aclose()


async def test_a_reset_takes_a_context_prepared_ahead() -> None:
    pool = BrowserPool(1, spares=2, idle_close_s=None)
    env = make_env("click-test", pool=pool, screenshots=False, recycle_pages=False)
    try:
        await env.reset(seed=0)
        assert pool.spares_used == 0
        deadline = time.monotonic() + 30
        while pool.spares_ready("miniwob/click-test@500x340") < 1:  # one env: one spare
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        first_context = env._lease.context if env._lease else None
        result = await env.reset(seed=1)
        assert pool.spares_used == 1 and not result.done
        assert env._lease is not None and env._lease.context is not first_context
        assert pool.spares_ready("miniwob/click-test@500x340") == 0  # being made again
    finally:
        await env.close()
        await pool.aclose()


async def test_contexts_per_browser_bounds_concurrent_episodes() -> None:
    pool = BrowserPool(1, contexts_per_browser=1, spares=0, idle_close_s=None)
    first = make_env("click-test", pool=pool, screenshots=False)
    second = make_env("click-test", pool=pool, screenshots=False)
    try:
        await first.reset(seed=0)
        waiting = asyncio.ensure_future(second.reset(seed=1))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await first.close()
        result = await asyncio.wait_for(waiting, 30)
        assert not result.done
    finally:
        await second.close()
        await pool.aclose()


async def test_registry_envs_share_a_pool_closed_by_close_shared() -> None:
    before = chromium_descendants()
    env = registry.make("miniwob/click-test-v0")
    try:
        result = await env.reset(seed=0)
        result = await env.step(registry.oracle("miniwob/click-test-v0")([result.observation]))
        assert result.reward == 1.0
        assert shared_pool().browsers_running >= 1 and env.env.task.key == "miniwob/click-test"
    finally:
        await env.close()
    started = chromium_descendants() - before
    await registry.close_shared()
    assert await _gone(started) == set()


DRIVER = """
import asyncio, os, sys
from envs.browser.chromium import CHROMIUM_ARGS, chromium_executable
from envs.browser.miniwob import make_env
from envs.browser.pool import BrowserPool

async def main():
    env = make_env("click-test", pool=BrowserPool(1), screenshots=False)
    await env.reset(seed=0)
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_killing_the_driving_process_takes_its_browsers_along() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == "ready"
        started = chromium_descendants()
        assert started
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert await _gone(started, within_s=15) == set()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
