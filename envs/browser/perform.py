"""Carrying out one parsed action (envs/browser/actions.py) on the episode's tabs.

Element actions find their element by its ``data-bid`` attribute (set by
envs/browser/axtree.py). A click or double click on an element that can take it now is
sent at once through the page's :class:`~envs.browser.pointer.Pointer` (one call into the
page, then the mouse events together: a few ms instead of two animation frames); any
other element action, and a click on an element that cannot take it yet, goes through
Playwright's locator API, which waits for the element to be visible, stable and enabled
for up to the action timeout: a click on a button still being shown succeeds, one on a
hidden element fails after the timeout. An unknown bid fails at once (one round trip),
not after the timeout. Mouse actions at coordinates and scrolls go through the pointer
too, so it always knows where the mouse is.

Failures the agent caused raise :class:`ActionError`; Playwright's own errors (an
element that never became clickable, a navigation that failed) propagate for the env to
show as the action's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envs.browser.actions import ActionError, BrowserCall
from envs.browser.pointer import Pointer

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Locator, Page

NAVIGATION_TIMEOUT_FACTOR = 5  # goto/go_back may take this many action timeouts


@dataclass
class Tabs:
    """The episode's context, the tab actions go to, what the agent said to the user, and
    how to get a page's pointer."""

    context: BrowserContext
    active: Page
    viewport: tuple[int, int]
    timeout_ms: float
    pointer: Callable[[Page], Awaitable[Pointer]]
    messages_to_user: list[str] = field(default_factory=list)


async def perform(call: BrowserCall, tabs: Tabs) -> None:
    """Run `call` against `tabs` (see the module docstring for what fails how)."""
    page, args, name = tabs.active, call.args, call.name
    if name in ("click", "dblclick"):
        await _click(call, page, await tabs.pointer(page), tabs.timeout_ms)
        return
    if "bid" in args:
        element = await _element(page, call)
        await _on_element(call, element, tabs.timeout_ms)
        if name == "hover":
            await _follow(await tabs.pointer(page), element)
        return
    if name in ("mouse_click", "mouse_move"):
        width, height = tabs.viewport
        x, y = args["x"], args["y"]
        if not (0 <= x < width and 0 <= y < height):
            raise ActionError(f"{name}: ({x}, {y}) is off the screen ({width}x{height})")
        pointer = await tabs.pointer(page)
        if name == "mouse_click":
            await pointer.click(x, y, button=args["button"])
        else:
            await pointer.move(x, y)
    elif name == "scroll":
        await (await tabs.pointer(page)).wheel(args["delta_x"], args["delta_y"])
    elif name == "keyboard_type":
        await page.keyboard.type(args["text"])
    elif name == "keyboard_press":
        await page.keyboard.press(args["key"])
    elif name == "goto":
        await page.goto(args["url"], timeout=tabs.timeout_ms * NAVIGATION_TIMEOUT_FACTOR)
    elif name == "go_back":
        await page.go_back(timeout=tabs.timeout_ms * NAVIGATION_TIMEOUT_FACTOR)
    elif name == "new_tab":
        tabs.active = await tabs.context.new_page()
    elif name == "tab_focus":
        pages = tabs.context.pages
        if not 0 <= args["index"] < len(pages):
            raise ActionError(f"tab_focus: no tab {args['index']} ({len(pages)} open)")
        tabs.active = pages[args["index"]]
        await tabs.active.bring_to_front()
    elif name == "send_msg_to_user":
        tabs.messages_to_user.append(args["text"])
    elif name == "noop" and args["wait_ms"]:
        await asyncio.sleep(args["wait_ms"] / 1000)


async def _click(call: BrowserCall, page: Page, pointer: Pointer, timeout: float) -> None:
    """At once through the pointer when the element can take the click, else Playwright's
    waiting click (which then says why it could not)."""
    bid, count = call.args["bid"], 2 if call.name == "dblclick" else 1
    point = await pointer.click_point(bid)
    if point == "missing":
        raise ActionError(f"{call.name}: no element with bid {bid!r} on the page")
    if isinstance(point, tuple):
        await pointer.click(*point, button=call.args["button"], count=count)
        return
    element = page.locator(f'[data-bid="{bid}"]')
    await _on_element(call, element, timeout)
    await _follow(pointer, element)


async def _follow(pointer: Pointer, element: Locator) -> None:
    """Playwright moved the mouse to the element's centre: the pointer learns it."""
    box = await element.bounding_box()
    if box is not None:
        pointer.x, pointer.y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


async def _element(page: Page, call: BrowserCall) -> Locator:
    bid = call.args["bid"]
    element = page.locator(f'[data-bid="{bid}"]')  # bids match [A-Za-z0-9_.-]+: no quoting
    if await element.count() == 0:
        raise ActionError(f"{call.name}: no element with bid {bid!r} on the page")
    return element


async def _on_element(call: BrowserCall, element: Locator, timeout: float) -> None:
    args, name = call.args, call.name
    if name == "click":
        await element.click(button=args["button"], timeout=timeout)
    elif name == "dblclick":
        await element.dblclick(button=args["button"], timeout=timeout)
    elif name == "fill":
        await element.fill(args["value"], timeout=timeout)
    elif name == "select_option":
        await element.select_option(args["options"], timeout=timeout)
    elif name == "press":
        await element.press(args["key_comb"], timeout=timeout)
    elif name == "hover":
        await element.hover(timeout=timeout)
    elif name == "focus":
        await element.focus(timeout=timeout)
    elif name == "clear":
        await element.clear(timeout=timeout)
