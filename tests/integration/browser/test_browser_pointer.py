"""The pointer's clicks on real Chromium: the same events a Playwright click sends, the
fall back to Playwright's waiting click when an element cannot take a click yet, and
scrolls where the mouse is."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from playwright.async_api import BrowserContext, Page
from playwright.async_api import Error as PlaywrightError

from envs.browser.actions import ActionError, GotoPolicy, parse_call
from envs.browser.env import _pointer
from envs.browser.perform import Tabs, perform
from envs.browser.pointer import Pointer
from envs.browser.pool import BrowserPool, Lease

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

PAGE = """<!doctype html><html><body style="margin:0">
<button id="a" data-bid="a" style="width:80px;height:30px">A</button>
<button id="late" data-bid="late" disabled>late</button>
<button id="hidden" data-bid="hidden" style="visibility:hidden">hidden</button>
<button id="under" data-bid="under" style="position:absolute;left:0;top:100px">under</button>
<div id="lid" style="position:absolute;left:0;top:95px;width:200px;height:40px"></div>
<div id="box" data-bid="box"
  style="position:absolute;left:0;top:150px;width:200px;height:80px;overflow:auto">
  <div style="height:400px">long</div></div>
<button id="far" data-bid="far" style="position:absolute;left:0;top:2000px">far</button>
<script>
window.seen = [];
for (const type of ['pointerover', 'pointerenter', 'mouseover', 'mouseenter', 'pointermove',
    'mousemove', 'pointerdown', 'mousedown', 'focus', 'pointerup', 'mouseup', 'click',
    'dblclick', 'contextmenu', 'auxclick']) {
  document.addEventListener(type, (e) => seen.push(
    [type, e.target.id || e.target.tagName, e.isTrusted, e.button, e.buttons, e.detail]), true);
}
</script></body></html>"""


async def _prepare(context: BrowserContext) -> Page:
    page = await context.new_page()
    await page.set_content(PAGE)
    return page


@pytest_asyncio.fixture(loop_scope="module")
async def lease(pool: BrowserPool) -> AsyncIterator[Lease]:
    leased = await pool.lease("pointer-test", _prepare, viewport={"width": 400, "height": 300})
    yield leased
    await leased.close()


def _tabs(lease: Lease, timeout_ms: float = 2_000) -> Tabs:
    return Tabs(lease.context, lease.page, (400, 300), timeout_ms, _pointer)


async def _act(tabs: Tabs, text: str) -> None:
    await perform(parse_call(text, GotoPolicy.only(())), tabs)


class CountingPointer(Pointer):
    clicks = 0

    async def click(self, x: float, y: float, *, button: str = "left", count: int = 1) -> None:
        self.clicks += 1
        await super().click(x, y, button=button, count=count)


async def _seen(page: Page) -> list[list[object]]:
    return await page.evaluate("() => seen.splice(0)")


@pytest.mark.parametrize(
    ("ours", "playwright"),
    [
        ("click('a')", {}),
        ("dblclick('a')", {"click_count": 2}),
        ("click('a', button='right')", {"button": "right"}),
        ("click('a', button='middle')", {"button": "middle"}),
    ],
)
async def test_a_pointer_click_sends_what_a_playwright_click_sends(
    pool: BrowserPool, ours: str, playwright: dict[str, object]
) -> None:
    runs = []
    for use_pointer in (True, False):
        leased = await pool.lease("pointer-test", _prepare, viewport={"width": 400, "height": 300})
        try:
            page = leased.page
            await _seen(page)
            if use_pointer:
                pointer = CountingPointer((await _pointer(page)).cdp)

                async def counting(_: Page, pointer: Pointer = pointer) -> Pointer:
                    return pointer

                tabs = _tabs(leased)
                tabs.pointer = counting
                await _act(tabs, ours)
                assert pointer.clicks == 1  # sent at once, not through Playwright
            else:
                await page.locator("#a").click(**playwright)  # type: ignore[arg-type]
            runs.append(await _seen(page))
        finally:
            await leased.close()
    ours_seen, theirs = runs
    assert ours_seen == theirs
    assert all(event[2] is True for event in ours_seen)  # trusted input, not dispatched DOM events
    assert "mousedown" in [event[0] for event in ours_seen]


async def test_an_element_not_yet_enabled_is_clicked_once_it_is(lease: Lease) -> None:
    page = lease.page
    await page.evaluate("() => setTimeout(() => { late.disabled = false; }, 300)")
    await _seen(page)
    started = time.monotonic()
    await _act(_tabs(lease), "click('late')")
    assert time.monotonic() - started >= 0.25  # Playwright's click waited for it
    assert ["click", "late"] in [event[:2] for event in await _seen(page)]


@pytest.mark.parametrize(
    ("bid", "why"), [("hidden", "visible"), ("under", "intercepts pointer events")]
)
async def test_an_element_that_cannot_take_a_click_fails_with_playwrights_reason(
    lease: Lease, bid: str, why: str
) -> None:
    await _seen(lease.page)
    # Long enough that Playwright checks the element at least once (and so names why it
    # cannot click it) on a busy machine, not only "waiting for locator".
    with pytest.raises(PlaywrightError, match=why):
        await _act(_tabs(lease, timeout_ms=1500), f"click('{bid}')")
    assert "click" not in [event[0] for event in await _seen(lease.page)]


async def test_an_unknown_bid_fails_at_once(lease: Lease) -> None:
    started = time.monotonic()
    with pytest.raises(ActionError, match="no element with bid 'nope'"):
        await _act(_tabs(lease), "click('nope')")
    assert time.monotonic() - started < 1.0  # not the 2 s action timeout


async def test_an_element_below_the_fold_is_scrolled_to_and_clicked(lease: Lease) -> None:
    page = lease.page
    await _seen(page)
    await _act(_tabs(lease), "click('far')")
    assert ["click", "far"] in [event[:2] for event in await _seen(page)]
    assert await page.evaluate("() => window.scrollY") > 0
    await page.evaluate("() => window.scrollTo(0, 0)")


async def test_a_scroll_goes_where_the_pointer_is(lease: Lease) -> None:
    page, tabs = lease.page, _tabs(lease)
    await _act(tabs, "mouse_click(100, 170)")  # over the scrollable box
    await _act(tabs, "scroll(0, 120)")
    await page.wait_for_function("() => box.scrollTop > 0")
    assert await page.evaluate("() => window.scrollY") == 0  # the box scrolled, not the page
