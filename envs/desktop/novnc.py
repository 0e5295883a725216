"""Driving a desktop through its noVNC page: Chromium, Playwright, the remote canvas.

The page is opened at the remote screen's size (`resize=off`: the canvas shows the
screen 1:1) and the actions land on the canvas `#noVNC_container canvas`, whose
bounding box maps screen coordinates to page coordinates. noVNC's own chrome (the
control bar, the status line) is hidden so it never covers the screen.

Screenshots are the canvas's own pixels (`toDataURL`): the remote screen exactly, with
no page chrome, in about 20 ms. Instead of sleeping after an action, :meth:`NoVNCView.settle`
waits until the canvas has had no draw for `quiet_ms` (an init script counts the 2D
context draws noVNC makes as framebuffer updates arrive), bounded by `max_ms`.

One Chromium per event loop serves every desktop env in it (:func:`shared_host`), each
episode in a fresh context; `envs.registry.close_shared()` closes it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

from envs.base import EnvError
from envs.browser.chromium import launch_chromium
from envs.desktop.actions import DesktopCommand

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, FloatRect, Page, Playwright

CANVAS = "#noVNC_container canvas"
WHEEL_STEP_PX = 50  # noVNC sends one wheel click per 50 px of wheel delta
_COUNT_DRAWS = """(() => {
  window.__agentflowDraws = 0;
  const proto = CanvasRenderingContext2D.prototype;
  for (const name of ["drawImage", "putImageData", "fillRect"]) {
    const original = proto[name];
    proto[name] = function (...args) {
      window.__agentflowDraws++;
      return original.apply(this, args);
    };
  }
})();"""
_SETTLE = """([quiet, max]) => new Promise((resolve) => {
  const start = performance.now();
  let last = window.__agentflowDraws, since = start;
  const tick = () => {
    const now = performance.now();
    if (window.__agentflowDraws !== last) { last = window.__agentflowDraws; since = now; }
    if (now - since >= quiet || now - start >= max) resolve(now - start);
    else setTimeout(tick, 10);
  };
  setTimeout(tick, 10);
})"""
_HIDE_CHROME = """#noVNC_control_bar_anchor, #noVNC_status, #noVNC_fallback_error
  { display: none !important; }"""
_CONNECTED = "document.documentElement.classList.contains('noVNC_connected')"


class ChromiumHost:
    """One Playwright driver and Chromium for the desktop envs of one event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._lock = asyncio.Lock()
        self.closed = False

    async def new_tab(self, screen: tuple[int, int] | None) -> tuple[BrowserContext, Page]:
        """A fresh context and page, ready for :meth:`NoVNCView.connect`."""
        context = await self._new_context(screen or (1280, 800))
        try:
            page = await context.new_page()
            await page.add_init_script(_COUNT_DRAWS)
        except BaseException:
            await context.close()
            raise
        return context, page

    async def _new_context(self, screen: tuple[int, int]) -> BrowserContext:
        async with self._lock:
            if self.closed:
                raise EnvError("the Chromium host is closed")
            if self._browser is None or not self._browser.is_connected():
                if self._playwright is None:
                    from playwright.async_api import async_playwright

                    self._playwright = await async_playwright().start()
                self._browser = await launch_chromium(self._playwright, headless=True)
        width, height = screen
        return await self._browser.new_context(viewport={"width": width, "height": height})

    async def aclose(self) -> None:
        async with self._lock:
            self.closed = True
            browser, playwright, self._browser, self._playwright = (
                self._browser, self._playwright, None, None,
            )  # fmt: skip
            if browser is not None:
                await browser.close()
            if playwright is not None:
                await playwright.stop()


_shared: ChromiumHost | None = None


def shared_host() -> ChromiumHost:
    """The Chromium host of this event loop (made on first use)."""
    global _shared
    loop = asyncio.get_running_loop()
    if _shared is None or _shared.loop is not loop or _shared.closed:
        _shared = ChromiumHost()
        from envs import registry

        registry.on_close_shared(close_shared_host)
    return _shared


async def close_shared_host() -> None:
    global _shared
    host, _shared = _shared, None
    if host is not None and host.loop is asyncio.get_running_loop():
        await host.aclose()


class NoVNCView:
    """A connected noVNC page; plays commands on its canvas and reads its pixels."""

    def __init__(self, context: BrowserContext, page: Page, url: str, screen: tuple[int, int]):
        self.context, self.page, self.url, self.screen = context, page, url, screen
        self.pointer = (0, 0)
        self._box: FloatRect | None = None

    @classmethod
    async def open(
        cls,
        host: ChromiumHost,
        url: str,
        screen: tuple[int, int] | None,
        *,
        timeout_s: float = 30.0,
    ) -> NoVNCView:
        """Open `url` and wait until it is connected; `screen` None: take the remote's."""
        context, page = await host.new_tab(screen)
        return await cls.connect(context, page, url, screen, timeout_s=timeout_s)

    @classmethod
    async def connect(
        cls,
        context: BrowserContext,
        page: Page,
        url: str,
        screen: tuple[int, int] | None,
        *,
        timeout_s: float = 30.0,
    ) -> NoVNCView:
        """Load `url` in a tab from :meth:`ChromiumHost.new_tab`; it owns `context` then."""
        try:
            await page.goto(url, timeout=timeout_s * 1000)
            await page.add_style_tag(content=_HIDE_CHROME)
            try:
                await page.wait_for_function(_CONNECTED, timeout=timeout_s * 1000, polling=50)
            except Exception as exc:
                status = await page.locator("#noVNC_status").text_content(timeout=1000)
                raise EnvError(f"noVNC did not connect to {url}: {status or exc}") from None
            size = await page.eval_on_selector(CANVAS, "c => [c.width, c.height]")
            width, height = int(size[0]), int(size[1])
            if screen is None or (width, height) != tuple(screen):
                await page.set_viewport_size({"width": width, "height": height})
            view = cls(context, page, url, (width, height))
            await page.eval_on_selector(CANVAS, "c => c.focus()")
            return view
        except BaseException:
            await context.close()
            raise

    async def settle(self, quiet_ms: int, max_ms: int = 3000) -> None:
        """Wait until the remote screen has stopped changing (or `max_ms` passed)."""
        if quiet_ms > 0:
            await self.page.evaluate(_SETTLE, [quiet_ms, max_ms])

    async def screenshot(self) -> bytes:
        """The remote screen as PNG bytes."""
        data_url = await self.page.eval_on_selector(CANVAS, "c => c.toDataURL('image/png')")
        return base64.b64decode(data_url.split(",", 1)[1])

    async def play(self, command: DesktopCommand, wait_s: float) -> None:
        """Send one validated command to the remote screen."""
        kind, mouse, keyboard = command.action_type, self.page.mouse, self.page.keyboard
        if kind == "DRAG_TO" and command.x is not None and command.y is not None:
            await mouse.down()  # pyautogui.dragTo: press where the pointer is, move, release
            await self._move(command.x, command.y, steps=8)
            await mouse.up()
            return
        if command.x is not None and command.y is not None:
            await self._move(command.x, command.y)
        px, py = await self._to_page(*self.pointer)
        button: Any = command.button
        if kind in ("CLICK", "RIGHT_CLICK", "DOUBLE_CLICK"):
            await mouse.click(px, py, button=button, click_count=command.clicks)
        elif kind == "MOUSE_DOWN":
            await mouse.down(button=button)
        elif kind == "MOUSE_UP":
            await mouse.up(button=button)
        elif kind == "SCROLL":  # pyautogui's sign: dy > 0 scrolls up, the wheel's is down
            await mouse.wheel(command.dx * WHEEL_STEP_PX, -command.dy * WHEEL_STEP_PX)
        elif kind in ("TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY"):
            await self._focus()
            if kind == "TYPING":
                await keyboard.type(command.text)
            elif kind == "PRESS":
                await keyboard.press(command.keys[0])
            elif kind == "KEY_DOWN":
                await keyboard.down(command.keys[0])
            elif kind == "KEY_UP":
                await keyboard.up(command.keys[0])
            else:
                for key in command.keys:
                    await keyboard.down(key)
                for key in reversed(command.keys):
                    await keyboard.up(key)
        elif kind == "WAIT":
            await asyncio.sleep(wait_s)

    async def _move(self, x: int, y: int, steps: int = 1) -> None:
        px, py = await self._to_page(x, y)
        await self.page.mouse.move(px, py, steps=steps)
        self.pointer = (x, y)

    async def _to_page(self, x: int, y: int) -> tuple[float, float]:
        """Page coordinates of the centre of screen pixel (x, y)."""
        if self._box is None:  # fixed: the viewport is the screen's size
            self._box = await self.page.locator(CANVAS).bounding_box()
            if self._box is None:
                raise EnvError("the noVNC canvas is not shown")
        box, (width, height) = self._box, self.screen
        return box["x"] + (x + 0.5) * box["width"] / width, box["y"] + (y + 0.5) * box[
            "height"
        ] / height

    async def _focus(self) -> None:
        await self.page.eval_on_selector(
            CANVAS, "c => { if (document.activeElement !== c) c.focus(); }"
        )

    async def close(self) -> None:
        try:
            await self.context.close()
        except Exception:  # the browser went first (a crash, or the host closed)
            pass
