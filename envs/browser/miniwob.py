"""MiniWoB++ tasks from the `miniwob` wheel's own HTML, as `miniwob/<task>-v0` envs.

The pages are read from the installed wheel's folder and served to the browser through
Playwright's request routing under ``http://miniwob.local/``: no HTTP server, no port,
and every other request is aborted, so a page cannot reach the network. The wheel's
Python package is never imported (it registers gym envs and needs Selenium).

An episode: the page's `Math.seedrandom(seed)` then `core.startEpisodeReal()`, with the
episode's time limit raised (10 s by default: a slow CPU would time out). The reward is
the page's own, scored as BrowserGym does: 1.0 when the raw reward is positive, else
0.0; the episode ends when the page says it is done (`WOB_DONE_GLOBAL`), or with 0.0
when the task's tab navigates away from the task page. The score is read from the task's
tab even while the agent works in another one.

Between episodes the page is recycled, as MiniWoB++'s own environment does (one page,
episode after episode): the HUD, timer, focus, storage and cookies go back to what a
fresh load has, the bids are renumbered, and the next `startEpisodeReal` regenerates the
task. A page the agent navigated away from, or that opened another tab, is closed
instead. `tests/integration/browser/test_browser_recycle.py` checks that a recycled
page's first observation equals a fresh page's for the same seed.

This module imports Playwright only when a page is driven: the browser family
(envs/browser/family.py) imports it to list the tasks and register their ids.
"""

from __future__ import annotations

import importlib.util
import mimetypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.base import EnvConfigError, EnvError
from envs.browser.cdp import session_for
from envs.browser.task import TaskStatus

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Page, Route

    from envs.browser.env import BrowserEnv

ORIGIN = "http://miniwob.local"
EPISODE_MAX_MS = 10**9  # the env's own turn and step limits bound an episode
MAX_EPISODE_STEPS = 10
READY_WAIT_MS = 10_000

# Seed, start, then wait in the page for its own readiness flag (the flight tasks load an
# iframe first): one round trip, no sleeps on the Python side.
SETUP_JS = """async ([seed, maxMs, waitMs]) => {
  Math.seedrandom(String(seed));
  core.EPISODE_MAX_TIME = maxMs;
  core.startEpisodeReal();
  const until = Date.now() + waitMs;
  while (!WOB_TASK_READY && Date.now() < until) {
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  return [Boolean(WOB_TASK_READY), core.getUtterance()];
}"""


# A finished episode's page made what a freshly loaded one is at `setup`: the timer
# stopped, the HUD (last reward, average, episodes done) as loaded, focus and storage
# cleared. `startEpisodeReal` then regenerates the task, scroll and selection, as it
# does between MiniWoB++'s own episodes.
RECYCLE_JS = """() => {
  if (typeof core === 'undefined' || !document.getElementById('reward-display')) return false;
  if (core.EP_TIMER !== null) { clearTimeout(core.EP_TIMER); core.EP_TIMER = null; }
  core.clearTimer();
  WOB_EPISODE_ID = 0;
  core.wob_latest = '-';
  core.wob_scores = [];
  document.getElementById('reward-display').innerHTML = core.DISPLAY_HTML;
  const focused = document.activeElement;
  if (focused && focused !== document.body) focused.blur();
  localStorage.clear();
  sessionStorage.clear();
  return true;
}"""


@cache
def html_root() -> Path:
    """The wheel's `html/` folder, found without importing the package."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or not spec.submodule_search_locations:
        raise EnvConfigError("MiniWoB++ tasks need the `miniwob` package: pip install miniwob")
    return Path(next(iter(spec.submodule_search_locations))) / "html"


def task_names() -> list[str]:
    """Every task page the wheel ships (the file names without `.html`)."""
    try:
        root = html_root() / "miniwob"
    except EnvConfigError:
        return []
    return sorted(p.stem for p in root.glob("*.html"))


class MiniWoBTask:
    """One MiniWoB++ task page (see the module docstring)."""

    viewport: tuple[int, int] = (500, 340)
    chrome_selectors: tuple[str, ...] = ("#query", "#reward-display", "#sync-task-cover")

    def __init__(self, name: str) -> None:
        if name not in task_names():
            raise EnvConfigError(f"no MiniWoB++ task {name!r} in the miniwob package")
        self.name = name
        self.key = f"miniwob/{name}"
        self.start_url = f"{ORIGIN}/miniwob/{name}.html"
        self.allowed_urls: tuple[str, ...] = (ORIGIN + "/",)

    async def prepare(self, context: BrowserContext) -> Page:
        await context.route("**/*", _serve)
        page = await context.new_page()
        await page.goto(self.start_url, wait_until="load")
        return page

    async def setup(self, page: Page, seed: int) -> str:
        cdp = await session_for(page)
        ready, goal = await cdp.evaluate(SETUP_JS, [seed, EPISODE_MAX_MS, READY_WAIT_MS])
        if not ready:
            raise EnvError(f"{self.key}: the page did not become ready in {READY_WAIT_MS} ms")
        return " ".join(str(goal).split())

    async def recycle(self, page: Page) -> bool:
        if not page.url.startswith(self.start_url):
            return False
        await page.context.clear_cookies()
        return bool(await (await session_for(page)).evaluate(RECYCLE_JS))

    async def status(self, page: Page) -> TaskStatus:
        if not page.url.startswith(self.start_url):
            return TaskStatus(0.0, True, {"reason": "navigated away from the task"})
        done, raw, reason = await (await session_for(page)).evaluate(
            "() => [WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL, WOB_REWARD_REASON]"
        )
        reward = 1.0 if done and raw > 0 else 0.0
        info: dict[str, Any] = {"raw_reward": raw, "success": reward > 0}
        if reason:
            info["reason"] = str(reason)
        return TaskStatus(reward, bool(done), info)


async def _serve(route: Route) -> None:
    """The wheel's files under ORIGIN; every other request is aborted."""
    url = route.request.url
    if not url.startswith(ORIGIN + "/"):
        await route.abort("blockedbyclient")
        return
    relative = url[len(ORIGIN) + 1 :].split("?", 1)[0].split("#", 1)[0]
    root = html_root()
    path = (root / relative).resolve()
    if root.resolve() not in path.parents or not path.is_file():
        await route.fulfill(status=404, body="not found")
        return
    media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if media.startswith("text/") or media.endswith("javascript"):
        media += "; charset=utf-8"  # the pages are UTF-8 (unicode-test)
    await route.fulfill(path=str(path), content_type=media)


def make_env(task: str, **kwargs: Any) -> BrowserEnv:
    """The env of one task (`miniwob/<task>-v0`); kwargs go to `BrowserEnv`."""
    from envs.browser.env import BrowserEnv

    return BrowserEnv(MiniWoBTask(task), **kwargs)
