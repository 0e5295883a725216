"""A pool of warm Chromium browsers; a clean browser context for every episode.

BrowserGym launches a browser per reset (about 2 s here). A browser is the expensive
part, and a *context* (cookies, storage, cache, pages) is what isolates one episode from
another, so the pool keeps `size` browsers running and hands each episode a context of
its own, closed when the episode ends.

Unless the task can recycle it: a lease made with `recycle` (MiniWoB++, whose pages run
episode after episode by design) gives its context back when it ends, if the episode
left just its one page and `recycle(page)` puts that page back the way `prepare` leaves
it; the key's next lease takes it instead of loading the page again. That turns the
per-episode cost from a context and a page load (~0.2 s of CPU) into one call into the
page, run in the background after the episode (the key's next lease waits for it only
when no other context is ready). Nothing else is ever reused: a context whose agent
opened a tab, navigated away, or whose recycle fails is closed.

Resets stay fast because contexts are prepared ahead: an env names a preparation (a
`prepare(context) -> Page` coroutine, e.g. routes set and the task page loaded) under a
key, and the pool keeps as many contexts prepared with it as that key has episodes open,
up to `spares`, making new ones in the background as they are taken. The first reset of
a key, or one that finds the spares taken, prepares its own. The last episode's context
closes in the background too (`Lease.close(wait=False)`), so a reset waits for neither.

Concurrency: at most `size * contexts_per_browser` leases are open at once (a semaphore;
more wait), each new context going to the browser with the fewest, so no browser holds
more than `contexts_per_browser` leased contexts (ready ones come on top: per key at
most `spares` plus the most episodes it has had open at once).

Processes: one Playwright driver per pool, `size` Chromium processes under it, started
on the first lease inside the running event loop. The pool closes them on `aclose()`
and after `idle_close_s` without a leased context; a browser that crashed is replaced
at the next lease. If the process that owns the pool dies (even by SIGKILL), the driver
sees its pipe close and takes its browsers with it.

`shared_pool()` is the pool envs made through the registry use, one per event loop;
`envs.registry.close_shared()` closes it (gateway shutdown, end of a run or a warm start).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envs.base import EnvError
from envs.browser.chromium import launch_chromium

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Page, Playwright

POOL_SIZE_ENV_VAR = "AGENTFLOW_BROWSER_POOL_SIZE"
Prepare = Callable[["BrowserContext"], Awaitable["Page"]]
Recycle = Callable[["Page"], Awaitable[bool]]


@dataclass
class Lease:
    """One episode's context and page; `close()` ends them (idempotent)."""

    key: str
    context: BrowserContext
    page: Page
    pool: BrowserPool
    slot: _Slot
    recycle: Recycle | None = None
    closed: bool = False

    async def close(self, *, wait: bool = True) -> None:
        """Recycle the context for the key's next lease when the lease's `recycle`
        allows, else close it; with `wait=False` the close runs in the background (a
        reset need not wait for the last episode's context to go; `pool.aclose()` still
        does). A recycle always runs in the background: it is a short call into the page
        that may wait for a frame, and a context kept for the next episode holds nothing
        the caller waits to see gone; the key's next lease that finds no ready context
        waits for it rather than preparing another (a failed recycle closes the
        context)."""
        if self.closed:
            return
        self.closed = True
        self.pool._active[self.key] -= 1
        if self.recycle is not None and self._recyclable():
            self.pool._track_recycle(self.key, self._recycle_or_close(self.recycle))
            return
        if wait:
            await self._close_context()
        else:
            self.pool._track(asyncio.get_running_loop().create_task(self._close_context()))

    def _recyclable(self) -> bool:
        """Whether the context may go back to the pool's ready ones for this key: a live
        one with just its own page left, while the key keeps fewer than it uses."""
        pool, browser = self.pool, self.slot.browser
        if pool._closed or len(pool._ready[self.key]) >= pool._keep(self.key):
            return False
        if browser is None or not browser.is_connected() or self.context.pages != [self.page]:
            return False  # a tab the agent opened, a crash: start the next one clean
        return True

    async def _recycle_or_close(self, recycle: Recycle) -> None:
        try:
            recycled = await recycle(self.page)
        except Exception:  # noqa: BLE001 - a page that cannot be recycled is closed instead
            recycled = False
        pool = self.pool
        if not recycled or pool._closed or len(pool._ready[self.key]) >= pool._keep(self.key):
            await self._close_context()
            return
        pool._ready[self.key].append((self.context, self.page, self.slot))
        pool.recycled += 1
        pool._release(self.slot, context_kept=True)

    async def _close_context(self) -> None:
        try:
            with contextlib.suppress(Exception):  # a crashed browser took it already
                await self.context.close()
        finally:
            self.pool._release(self.slot)


@dataclass
class _Slot:
    browser: Browser | None = None
    leased: int = 0
    starting: asyncio.Lock = field(default_factory=asyncio.Lock)


class BrowserPool:
    """`size` warm browsers (default `AGENTFLOW_BROWSER_POOL_SIZE`, else 2), each holding
    at most `contexts_per_browser` leased contexts; see the module docstring. Made inside
    a running event loop and used only from it. `playwright`: a running driver to launch
    the browsers with (its owner stops it), else the pool runs its own."""

    def __init__(
        self,
        size: int | None = None,
        *,
        contexts_per_browser: int = 16,
        spares: int = 2,
        idle_close_s: float | None = 120.0,
        headless: bool = True,
        playwright: Playwright | None = None,
    ) -> None:
        size = size if size is not None else int(os.environ.get(POOL_SIZE_ENV_VAR, "2"))
        if size < 1 or contexts_per_browser < 1 or spares < 0:
            raise EnvError("a browser pool needs size >= 1, contexts >= 1, spares >= 0")
        self.size = size
        self.contexts_per_browser = contexts_per_browser
        self.spares = spares
        self.idle_close_s = idle_close_s
        self.headless = headless
        # A driver handed in is shared with its owner, who stops it; else the pool starts
        # its own on the first lease and stops it when it shuts down.
        self._own_driver = playwright is None
        self._playwright: Playwright | None = playwright
        self._slots = [_Slot() for _ in range(size)]
        self._capacity = asyncio.Semaphore(size * contexts_per_browser)
        self._ready: dict[str, list[tuple[BrowserContext, Page, _Slot]]] = defaultdict(list)
        self._preparing: dict[asyncio.Task[None], str] = {}  # spares being made, by key
        self._closing: set[asyncio.Task[None]] = set()
        self._recycling: defaultdict[str, set[asyncio.Task[None]]] = defaultdict(set)
        self._active: Counter[str] = Counter()  # open leases by key
        self._peak: Counter[str] = Counter()  # the most open at once, by key
        self._open = 0  # leases handed out and not yet released
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_close: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.loop = asyncio.get_running_loop()
        self.launches = 0  # browsers started, for tests and the bench
        self.spares_used = 0  # leases served by a context prepared ahead or recycled
        self.recycled = 0  # ended leases whose context went back to the ready ones
        self.prepared = 0  # contexts made (a page load each), for ready spares or leases

    # -- leasing ------------------------------------------------------------------------

    async def lease(
        self, key: str, prepare: Prepare, *, recycle: Recycle | None = None, **context_options: Any
    ) -> Lease:
        """A context made by `prepare` (a spare or recycled one when there is one).
        `recycle`: how to make the page of an ended lease ready for the key's next one
        (the context is closed when it is None or says False)."""
        if self._closed:
            raise EnvError("the browser pool is closed")
        await self._capacity.acquire()
        try:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            if self._idle_close is not None and not self._idle_close.done():
                await asyncio.shield(self._idle_close)  # let it finish; start afresh
            spare = self._take_spare(key)
            if spare is None and self._recycling[key]:  # one is about to be ready
                await asyncio.wait(set(self._recycling[key]), return_when=asyncio.FIRST_COMPLETED)
                spare = self._take_spare(key)
            if spare is None:
                slot = await self._pick_slot()
                context, page = await self._prepare(slot, prepare, context_options)
            else:
                context, page, slot = spare
                self.spares_used += 1
            self._active[key] += 1
            self._peak[key] = max(self._peak[key], self._active[key])
            self._open += 1
            self._refill(key, prepare, context_options)
            return Lease(key, context, page, self, slot, recycle)
        except BaseException:
            self._capacity.release()
            raise

    def _take_spare(self, key: str) -> tuple[BrowserContext, Page, _Slot] | None:
        ready = self._ready.get(key)
        while ready:
            context, page, slot = ready.pop()
            if slot.browser is not None and slot.browser.is_connected() and not page.is_closed():
                return context, page, slot  # counted on its slot since it was made
            slot.leased -= 1  # its browser died: the spare went with it
        return None

    async def _pick_slot(self) -> _Slot:
        async with self._lock:
            slot = min(self._slots, key=lambda s: s.leased)
            slot.leased += 1
        return slot

    async def _browser(self, slot: _Slot) -> Browser:
        async with slot.starting:
            if slot.browser is None or not slot.browser.is_connected():
                if self._playwright is None:
                    from playwright.async_api import async_playwright

                    self._playwright = await async_playwright().start()
                slot.browser = await launch_chromium(self._playwright, headless=self.headless)
                self.launches += 1
            return slot.browser

    async def _prepare(
        self, slot: _Slot, prepare: Prepare, options: dict[str, Any]
    ) -> tuple[BrowserContext, Page]:
        try:
            browser = await self._browser(slot)
            context = await browser.new_context(**options)
            try:
                page = await prepare(context)
            except BaseException:
                with contextlib.suppress(Exception):
                    await context.close()
                raise
            self.prepared += 1
        except BaseException:
            slot.leased -= 1
            raise
        return context, page

    def _refill(self, key: str, prepare: Prepare, options: dict[str, Any]) -> None:
        """Keep as many spares of `key` as it has episodes open, up to `spares`: one env
        resetting in a loop finds one ready, eight concurrent ones find up to `spares`."""
        wanted = min(self.spares, self._active[key])
        if len(self._ready[key]) + self._pending(key) >= wanted:
            return
        task = asyncio.get_running_loop().create_task(self._make_spare(key, prepare, options))
        self._preparing[task] = key
        task.add_done_callback(lambda done: self._preparing.pop(done, None))

    def _pending(self, key: str) -> int:
        """Contexts of `key` on their way to ready: spares being made, pages recycling."""
        return sum(1 for k in self._preparing.values() if k == key) + len(self._recycling[key])

    async def _make_spare(self, key: str, prepare: Prepare, options: dict[str, Any]) -> None:
        slot = await self._pick_slot()
        try:
            context, page = await self._prepare(slot, prepare, options)
        except Exception:
            return  # a spare is an optimisation; the next lease prepares its own
        if self._closed:
            with contextlib.suppress(Exception):
                await context.close()
            slot.leased -= 1
            return
        self._ready[key].append((context, page, slot))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _track_recycle(self, key: str, recycling: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(recycling)
        self._track(task)
        self._recycling[key].add(task)
        task.add_done_callback(self._recycling[key].discard)

    def _keep(self, key: str) -> int:
        """Ready contexts worth keeping for a key, asked as one of its leases ends: its
        `spares` and one for each episode it has had open at once. Fewer would close
        recycled pages that the next resets then prepare again (a page load each, ~0.2 s
        of CPU): with a key's episodes ending and starting in turn, the spares made
        while many were open would push the returning ones out."""
        return self.spares + self._peak[key]

    def _release(self, slot: _Slot, *, context_kept: bool = False) -> None:
        if not context_kept:  # a kept context still counts on its browser, as a spare
            slot.leased -= 1
        self._open -= 1
        self._capacity.release()
        if self.idle_close_s is not None and self._open == 0 and not self._closed:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = self.loop.call_later(self.idle_close_s, self._start_idle_close)

    def _start_idle_close(self) -> None:
        self._idle_timer = None
        self._idle_close = self.loop.create_task(self._close_idle())

    async def _close_idle(self) -> None:
        if self._open == 0 and not self._closed:
            await self._shutdown()

    # -- closing ------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Close spares, browsers and the driver; a later lease starts them again."""
        for task in list(self._preparing):
            task.cancel()
        for task in [*self._preparing, *self._closing]:  # cancelled spares, closing leases
            with contextlib.suppress(BaseException):
                await task
        for ready in self._ready.values():
            for context, _, slot in ready:
                slot.leased -= 1
                with contextlib.suppress(Exception):
                    await context.close()
        self._ready.clear()
        self._peak.clear()
        for slot in self._slots:
            if slot.browser is not None:
                with contextlib.suppress(Exception):
                    await slot.browser.close()
                slot.browser = None
        if self._playwright is not None and self._own_driver:
            with contextlib.suppress(Exception):
                await self._playwright.stop()
            self._playwright = None

    async def aclose(self) -> None:
        """Close everything; idempotent. Leases still open end with their browsers."""
        if self._closed:
            return
        self._closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._idle_close is not None and self._idle_close is not asyncio.current_task():
            with contextlib.suppress(BaseException):
                await self._idle_close
        await self._shutdown()

    async def settle(self) -> None:
        """Wait for the recycles in flight: the ended leases' contexts are then ready (or
        closed). A caller that wants its next lease to get the last one's page."""
        while tasks := {t for pending in self._recycling.values() for t in pending}:
            await asyncio.wait(tasks)

    def spares_ready(self, key: str) -> int:
        return len(self._ready.get(key, ()))

    @property
    def browsers_running(self) -> int:
        return sum(1 for s in self._slots if s.browser is not None and s.browser.is_connected())


_shared: BrowserPool | None = None


def shared_pool() -> BrowserPool:
    """The pool of this event loop (made on first use); `close_shared_pool()` ends it."""
    global _shared
    loop = asyncio.get_running_loop()
    if _shared is None or _shared.loop is not loop or _shared._closed:
        _shared = BrowserPool()
        from envs import registry

        registry.on_close_shared(close_shared_pool)
    return _shared


async def close_shared_pool() -> None:
    """Close the shared pool of this event loop (`envs.registry.close_shared()` calls it:
    the gateway's shutdown, the end of a run, a warm start, an evaluation)."""
    global _shared
    pool, _shared = _shared, None
    if pool is not None and pool.loop is asyncio.get_running_loop():
        await pool.aclose()
