"""Carrying out one parsed action (envs/browser/actions.py) on the episode's tabs.

Element actions find their element by its ``data-bid`` attribute (set by
envs/browser/axtree.py) and go through Playwright's locator API, which waits for the
element to be visible, stable and enabled for up to the action timeout: a click on a
button still fading in succeeds, one on a hidden element fails after the timeout. An
unknown bid fails at once (one ``count()`` round trip), not after the timeout.

Failures the agent caused raise :class:`ActionError`; Playwright's own errors (an
element that never became clickable, a navigation that failed) propagate for the env to
show as the action's error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envs.browser.actions import ActionError, BrowserCall

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Locator, Page

NAVIGATION_TIMEOUT_FACTOR = 5  # goto/go_back may take this many action timeouts


@dataclass
class Tabs:
    """The episode's context, the tab actions go to, and what the agent said to the user."""

    context: BrowserContext
    active: Page
    viewport: tuple[int, int]
    timeout_ms: float
    messages_to_user: list[str] = field(default_factory=list)


async def perform(call: BrowserCall, tabs: Tabs) -> None:
    """Run `call` against `tabs` (see the module docstring for what fails how)."""
    if "bid" in call.args:
        await _on_element(call, await _element(tabs.active, call), tabs.timeout_ms)
        return
    page, args, name = tabs.active, call.args, call.name
    if name in ("mouse_click", "mouse_move"):
        width, height = tabs.viewport
        x, y = args["x"], args["y"]
        if not (0 <= x < width and 0 <= y < height):
            raise ActionError(f"{name}: ({x}, {y}) is off the screen ({width}x{height})")
        if name == "mouse_click":
            await page.mouse.click(x, y, button=args["button"])
        else:
            await page.mouse.move(x, y)
    elif name == "scroll":
        await page.mouse.wheel(args["delta_x"], args["delta_y"])
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
