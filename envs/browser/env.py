"""`BrowserEnv`: one browser task per episode, BrowserGym's actions, a warm pool.

reset: a context from the pool (prepared ahead: routes set, the task page loaded; or
the last episode's, recycled by the task when it can: envs/browser/pool.py), the task
started with the seed, the first observation. step: the action parsed
(envs/browser/actions.py; never executed as code), carried out through Playwright
(envs/browser/perform.py), the task scored, the next observation.

Observation: a user message (goal, the compact page text, the last action's error),
`text` (the compact page text), `axtree` (the whole accessibility tree), `url`, `image`
(a PNG screenshot, unless `screenshots=False`); `info` has the open tabs, the focused
bid, the last action's error, what the agent sent the user and the task's own fields
(MiniWoB++: `raw_reward`, `success`). A bad action (unparseable, an unknown bid, a point
off the screen, a forbidden URL, an unknown key, an element that never became
clickable) is an error in the next observation, and the episode goes on; a step past
its `timeout_s` raises `StepTimeout`, a browser that died raises `EnvError` (the next
reset gets a new one).

Accepts `BrowserAction` and `TextAction` (the white-box agent's reply is the call).
An observation costs two round trips to the browser: the bid-marking pass, then the
two tree reads, the screenshot and the task's score sent together.
"""

from __future__ import annotations

import asyncio
import base64
import weakref
from typing import TYPE_CHECKING, Any

from envs.base import (
    Action,
    BrowserAction,
    EnvClosed,
    EnvError,
    EpisodeFinished,
    InvalidAction,
    Message,
    Observation,
    StepResult,
    StepTimeout,
    TextAction,
)
from envs.browser.actions import ActionError, GotoPolicy, parse_call
from envs.browser.axtree import (
    build_tree,
    compact,
    flatten,
    mark_bids,
    read_trees,
    unmark_bids,
)
from envs.browser.cdp import Cdp, session_for
from envs.browser.perform import Tabs, perform
from envs.browser.pointer import Pointer
from envs.browser.pool import BrowserPool, Lease, shared_pool
from envs.browser.task import BrowserTask, TaskStatus

if TYPE_CHECKING:
    from playwright.async_api import Page

MAX_ERROR_CHARS = 160


class BrowserEnv:
    """The Env protocol over one :class:`BrowserTask` (see the module docstring)."""

    def __init__(
        self,
        task: BrowserTask,
        *,
        pool: BrowserPool | None = None,
        screenshots: bool = True,
        compact_chars: int = 600,
        action_timeout_ms: int = 2_000,
        viewport: tuple[int, int] | None = None,
        recycle_pages: bool = True,
    ) -> None:
        """`recycle_pages`: an ended episode's page goes back to the pool for this task's
        next episode when the task can put it back as loaded (`BrowserTask.recycle`);
        False: every episode gets a new context."""
        self.task = task
        self.recycle_pages = recycle_pages
        self._pool = pool
        self.screenshots = screenshots
        self.compact_chars = compact_chars
        self.action_timeout_ms = action_timeout_ms
        self.viewport = viewport or task.viewport
        self.goto_policy = GotoPolicy.only(task.allowed_urls)
        self._lease: Lease | None = None
        self._tabs: Tabs | None = None
        self._goal = ""
        self._steps = 0
        self._done = False
        self._closed = False
        self._error: str | None = None

    # -- Env protocol -------------------------------------------------------------------

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        if self._closed:
            raise EnvClosed("reset after close()")
        await self._end_episode(wait=False)
        pool = self._pool or shared_pool()
        width, height = self.viewport
        self._lease = await pool.lease(
            f"{self.task.key}@{width}x{height}",
            self.task.prepare,
            recycle=self._recycle if self.recycle_pages else None,
            viewport={"width": width, "height": height},
        )
        page = self._lease.page
        self._tabs = Tabs(
            self._lease.context, page, self.viewport, self.action_timeout_ms, _pointer
        )
        self._goal = await self.task.setup(page, 0 if seed is None else seed)
        self._steps, self._done, self._error = 0, False, None
        return await self._observe(score=False)

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        if self._closed:
            raise EnvClosed("step after close()")
        if self._lease is None or self._tabs is None:
            raise EnvError("step before reset()")
        if self._done:
            raise EpisodeFinished("the episode is over; reset() starts another")
        if isinstance(action, TextAction):
            text = action.text
        elif isinstance(action, BrowserAction):
            text = action.call
        else:
            raise InvalidAction(f"a browser env takes browser or text actions, not {action.type}")
        self._steps += 1
        from playwright.async_api import Error as PlaywrightError

        try:
            async with asyncio.timeout(timeout_s):
                self._error = await self._apply(text)
                return await self._observe(score=True)
        except TimeoutError:
            raise StepTimeout(f"the browser step took longer than {timeout_s} s") from None
        except PlaywrightError as exc:  # the page or the browser went away under us
            raise EnvError(f"the browser failed: {exc.message.splitlines()[0]}") from exc

    async def state(self) -> dict[str, Any]:
        return {
            "task": self.task.key,
            "goal": self._goal,
            "steps": self._steps,
            "done": self._done,
            "url": None if self._tabs is None else self._tabs.active.url,
            "last_action_error": self._error,
        }

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._end_episode(wait=True)

    # -- actions and observations -------------------------------------------------------

    async def _apply(self, text: str) -> str | None:
        """Run one action; the error to show the agent, or None."""
        from playwright.async_api import Error as PlaywrightError

        assert self._tabs is not None
        try:
            await perform(parse_call(text, self.goto_policy), self._tabs)
        except ActionError as exc:
            return _short(str(exc))
        except PlaywrightError as exc:
            if self._tabs.active.is_closed():
                raise
            return _short(f"{text.strip()[:60]} failed: {exc.message.splitlines()[0]}")
        return None

    async def _observe(self, *, score: bool) -> StepResult:
        """The observation of the active tab; with `score`, the task's verdict on its page
        (read in the same round trip), else none yet (reset)."""
        assert self._tabs is not None and self._lease is not None
        tabs, page = self._tabs, self._tabs.active
        cdp = await session_for(page)
        # The screenshot waits for the next frame; it is asked for first, so the bids are
        # marked and the trees read while the frame is drawn (the bids change no pixel).
        shot = asyncio.ensure_future(self._screenshot(cdp))
        try:
            marks = await mark_bids(cdp, self.task.chrome_selectors)
            scored = self.task.status(self._lease.page) if score else _unscored()
            (document, ax), verdict = await asyncio.gather(read_trees(cdp), scored)
            image = await shot
        finally:
            shot.cancel()
        tree = build_tree(document, ax, marks.focused_bid)
        view = compact(tree, exclude=marks.chrome, max_chars=self.compact_chars)
        self._done = verdict.done
        content = f"Goal: {self._goal}\n{view}"
        if self._error:
            content += f"\nError: {self._error}"
        pages = tabs.context.pages
        info: dict[str, Any] = {
            "goal": self._goal,
            "tabs": await _tab_list(pages, page, marks.title),
            "active_tab": pages.index(page) if page in pages else 0,
            "focused_bid": marks.focused_bid,
            "last_action_error": self._error,
            "messages_to_user": list(tabs.messages_to_user),
            **(verdict.info or {}),
        }
        return StepResult(
            observation=Observation(
                messages=[Message(role="user", content=content)],
                text=view,
                axtree=flatten(tree),
                url=page.url,
                image=image,
            ),
            reward=verdict.reward,
            terminated=verdict.done,
            info=info,
        )

    async def _screenshot(self, cdp: Cdp) -> bytes | None:
        """The viewport as PNG, straight from CDP (Playwright's own screenshot waits for
        fonts and animations: twice as slow here)."""
        if not self.screenshots:
            return None
        shot = await cdp.send("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(shot["data"])

    async def _end_episode(self, *, wait: bool) -> None:
        lease = self._lease
        self._lease = self._tabs = None
        if lease is not None:
            await lease.close(wait=wait)

    async def _recycle(self, page: Page) -> bool:
        """The task's recycle, then the bids forgotten (renumbered from 1 next time) and
        the mouse back where a new page has it (no element left hovered)."""
        if not await self.task.recycle(page):
            return False
        pointer = await _pointer(page)
        await unmark_bids(pointer.cdp)
        await pointer.move(0, 0)
        return True


# One pointer per page for as long as the page lives (a recycled page keeps it).
_POINTERS: weakref.WeakKeyDictionary[Page, Pointer] = weakref.WeakKeyDictionary()


async def _pointer(page: Page) -> Pointer:
    pointer = _POINTERS.get(page)
    if pointer is None:
        pointer = _POINTERS[page] = Pointer(await session_for(page))
    return pointer


async def _unscored() -> TaskStatus:
    return TaskStatus()


async def _tab_list(pages: list[Page], active: Page, title: str) -> list[dict[str, Any]]:
    """Index, url and title of each open tab (the others' titles cost a round trip each,
    so only episodes that opened tabs pay it)."""
    titles = await asyncio.gather(*(_title(p) for p in pages if p is not active))
    others = iter(titles)
    return [
        {"index": i, "url": p.url, "title": title if p is active else next(others)}
        for i, p in enumerate(pages)
    ]


async def _title(page: Page) -> str:
    from playwright.async_api import Error as PlaywrightError

    try:
        return await page.title()
    except PlaywrightError:  # closing, or navigating right now
        return ""


def _short(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
