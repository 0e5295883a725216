"""What a browser task is, to the browser env: a page to prepare, a goal, a score.

`BrowserEnv` (envs/browser/env.py) owns the browser side (the pool, actions,
observations); a `BrowserTask` owns what a suite knows (MiniWoB++ is one:
envs/browser/miniwob.py). Tasks are plain objects made once per env and used for each
of its episodes. There is no teardown step: everything an episode made lives in its own
browser context, which the pool closes when the episode ends, unless the task can
`recycle` it: put the page back as a fresh one would be, for the next episode of the
same task (MiniWoB++ runs its episodes back to back in one page, by design).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Page


@dataclass(frozen=True)
class TaskStatus:
    """The task's verdict after a step: its reward and whether the episode is over."""

    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] | None = None


class BrowserTask(Protocol):
    """A suite's task, as `BrowserEnv` uses it."""

    key: str  # contexts prepared for one key are interchangeable (the pool's spares)
    start_url: str
    allowed_urls: tuple[str, ...]  # where `goto` may go (schemes and hosts of these)
    viewport: tuple[int, int]
    chrome_selectors: tuple[str, ...]  # the task's own chrome, left out of the compact view

    async def prepare(self, context: BrowserContext) -> Page:
        """Routes set and the start page loaded, before any seed is known (pool spares)."""
        ...

    async def setup(self, page: Page, seed: int) -> str:
        """Start the seeded episode on the prepared page; the goal text."""
        ...

    async def status(self, page: Page) -> TaskStatus:
        """Score the page as it is now."""
        ...

    async def recycle(self, page: Page) -> bool:
        """Make the page of a finished episode what `prepare` leaves, ready for `setup`;
        False when it cannot (the context is closed instead). Called only on a context
        with this one page, still on `start_url`."""
        ...
