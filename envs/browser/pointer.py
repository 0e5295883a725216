"""The mouse of one page, driven through CDP ``Input.dispatchMouseEvent``.

Why not Playwright's mouse: Chromium aligns a mouse *move* with the next animation
frame, so a move sent alone is acknowledged only when that frame comes (about 17 ms at
60 Hz), and Playwright's click sends move, press and release one after another, each
awaited: two frames or more per click. A press is a discrete event, and the renderer
flushes the moves queued before it, so move, press and release sent together arrive in
that order and are acknowledged in about 2 ms. They are the same trusted input events a
Playwright click sends, through the same browser input pipeline.

An element click first asks (:meth:`Pointer.click_point`) the page, in one call, whether
the element can take the click now, the checks a Playwright click makes: attached,
visible (a box and ``visibility: visible``), enabled, scrolled into view if needed,
not animated (no running CSS or Web Animation on it or an ancestor), and the element
itself (or one inside it) under the point it would click (its box's centre). When all
hold it is clicked there at once; otherwise the caller (envs/browser/perform.py) falls back to
Playwright's click, which waits for those conditions up to the action's timeout and says
which one failed. A script that moves an element by hand between two frames is not seen
as an animation: the click lands where the element is when it is sent.

The pointer keeps where the mouse is, so a scroll goes to the same point a user's wheel
would be over, whichever path moved the mouse last.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envs.browser.cdp import Cdp

# The point to click an element at, or why not now (a string: the caller falls back to
# Playwright's waiting click). `bid` is passed as an argument, never spliced into code.
CLICK_POINT_JS = """(bid) => {
  const el = document.querySelector(`[data-bid="${CSS.escape(bid)}"]`);
  if (!el) return 'missing';
  const style = getComputedStyle(el);
  if (style.visibility !== 'visible') return 'hidden';
  if (el.matches(':disabled') || el.closest('[aria-disabled="true"]')) return 'disabled';
  const running = document.getAnimations().some((a) => a.playState === 'running'
    && a.effect && a.effect.target && a.effect.target.contains(el));
  if (running) return 'animated';
  const box = () => {
    for (const r of el.getClientRects()) if (r.width > 0 && r.height > 0) return r;
    return null;
  };
  let r = box();
  if (!r) return 'hidden';
  const inside = (r) => r.left >= 0 && r.top >= 0
    && r.right <= window.innerWidth && r.bottom <= window.innerHeight;
  if (!inside(r)) {
    el.scrollIntoView({block: 'center', inline: 'center', behavior: 'instant'});
    r = box();
    if (!r) return 'hidden';
  }
  const x = r.left + r.width / 2, y = r.top + r.height / 2;
  if (x < 0 || y < 0 || x >= window.innerWidth || y >= window.innerHeight) return 'outside';
  const hit = document.elementFromPoint(x, y);
  if (!hit || !el.contains(hit)) return 'covered';
  return [x, y];
}"""


class Pointer:
    """The mouse over one page's CDP session (see the module docstring)."""

    def __init__(self, cdp: Cdp) -> None:
        self.cdp = cdp
        self.x = 0.0
        self.y = 0.0

    async def click(self, x: float, y: float, *, button: str = "left", count: int = 1) -> None:
        """Move to (x, y) and press and release `button` `count` times, sent together."""
        events = [self._event("mouseMoved", x, y)]
        for n in range(1, count + 1):
            events.append(self._event("mousePressed", x, y, button=button, count=n, down=True))
            events.append(self._event("mouseReleased", x, y, button=button, count=n))
        self.x, self.y = x, y
        await asyncio.gather(*events)

    async def move(self, x: float, y: float) -> None:
        self.x, self.y = x, y
        await self._event("mouseMoved", x, y)

    async def wheel(self, delta_x: float, delta_y: float) -> None:
        await self.cdp.send(
            "Input.dispatchMouseEvent",
            {"type": "mouseWheel", "x": self.x, "y": self.y, "deltaX": delta_x, "deltaY": delta_y},
        )

    async def click_point(self, bid: str) -> tuple[float, float] | str:
        """Where to click the element `bid` names if it can take a click now; else why
        not: ``"missing"`` (no such element), or a state a waiting click may outlast
        (``"hidden"``, ``"disabled"``, ``"animated"``, ``"outside"``, ``"covered"``)."""
        point = await self.cdp.evaluate(CLICK_POINT_JS, bid)
        if isinstance(point, list):
            return float(point[0]), float(point[1])
        return str(point)

    def _event(
        self,
        kind: str,
        x: float,
        y: float,
        *,
        button: str = "none",
        count: int = 0,
        down: bool = False,
    ) -> Any:
        """One event as Playwright's Chromium mouse sends it: `buttons` is the mask held
        after the event, `force` the pressure while one is held."""
        params: dict[str, Any] = {"type": kind, "x": x, "y": y, "button": button}
        if count:
            params["clickCount"] = count
        params["buttons"] = _BUTTON_MASK[button] if down else 0
        params["force"] = 0.5 if down else 0
        return self.cdp.send("Input.dispatchMouseEvent", params)


_BUTTON_MASK = {"none": 0, "left": 1, "right": 2, "middle": 4}
