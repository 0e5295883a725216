"""A page's CDP session whose answers come back as the browser sent them.

Playwright's public ``CDPSession.send`` walks every answer to swap its own objects for
API objects (``from_maybe_impl``), a recursive copy of each dict and list. A CDP answer
is JSON from the browser and holds none of them, and the trees an observation reads
run to thousands of nodes: the copy was about a third of the Python time of a browser
episode (cProfile over 200 MiniWoB++ episodes). :meth:`Cdp.send` calls the session's
implementation directly, the same call the public method makes before that copy, and
uses the public method where a Playwright version has no such implementation object.

:meth:`Cdp.evaluate` runs a function in the page's main world with ``Runtime.evaluate``:
half the CPU of Playwright's ``page.evaluate`` (measured: 0.9 ms against 2.0 ms across
the browser, the renderer, the driver and Python), which wraps every call in its own
serialisation. Arguments go in as JSON literals and results come back by value, so both
must be JSON: the env's own scripts (bids, click points) need no more.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.async_api import CDPSession, Page


class Cdp:
    """One CDP session (see the module docstring)."""

    def __init__(self, session: CDPSession) -> None:
        self.session = session
        impl = getattr(session, "_impl_obj", None)
        self._send: Callable[..., Awaitable[Any]] | None = getattr(impl, "send", None)

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._send is not None:
            answer = await self._send(method, params, None)  # no timeout, as the public one
        else:
            answer = await self.session.send(method, params)
        return answer

    async def evaluate(self, function: str, *args: Any) -> Any:
        """`function` (JavaScript source) called with `args` in the page; its result, by
        value (a returned promise is awaited). A script that throws raises Playwright's
        `Error`, as `page.evaluate` would."""
        call = f"({function})({', '.join(json.dumps(arg) for arg in args)})"
        answer = await self.send(
            "Runtime.evaluate", {"expression": call, "returnByValue": True, "awaitPromise": True}
        )
        details = answer.get("exceptionDetails")
        if details is not None:
            from playwright.async_api import Error as PlaywrightError

            thrown = (details.get("exception") or {}).get("description") or details.get("text")
            raise PlaywrightError(str(thrown or "the page's script failed").splitlines()[0])
        return answer.get("result", {}).get("value")


# One session per page for as long as the page lives: a recycled page keeps its session
# instead of opening one more per episode. The first caller's opening is shared, so
# callers racing on a new page get the same session.
_SESSIONS: weakref.WeakKeyDictionary[Page, asyncio.Future[Cdp]] = weakref.WeakKeyDictionary()


async def session_for(page: Page) -> Cdp:
    """The page's CDP session (opened on first use)."""
    opening = _SESSIONS.get(page)
    if opening is None:
        opening = _SESSIONS[page] = asyncio.ensure_future(_open(page))
    return await asyncio.shield(opening)


async def _open(page: Page) -> Cdp:
    return Cdp(await page.context.new_cdp_session(page))
