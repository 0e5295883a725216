"""Launching Debian's Chromium through Playwright (never a browser Playwright downloads).

The executable is `AGENTFLOW_CHROMIUM` when set; else, for a headless browser, Debian's
`chromium-headless-shell` (the old headless shell, which Playwright also uses for
headless: a new context with a page costs it about a quarter of the CPU time the full
browser's headless mode spends, 0.09 s against 0.39 s here, and a launch 0.09 s against
0.42 s), falling back to the first of `chromium`, `chromium-browser`, `google-chrome` on
`PATH`, which a headed browser always uses. The flags keep it off the network it must
not reach (background fetches, component updates, sync, QUIC) and working as root in a
container (`--no-sandbox`: the browser's own sandbox needs user namespaces the process
may not have; the env's isolation is the fresh context, the route allow-list and the
process limits around the gateway).
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from envs.base import EnvConfigError

if TYPE_CHECKING:
    from playwright.async_api import Browser, Playwright

CHROMIUM_ENV_VAR = "AGENTFLOW_CHROMIUM"
HEADLESS_SHELL = "chromium-headless-shell"
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")

CHROMIUM_ARGS: tuple[str, ...] = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
)


def chromium_executable(*, headless: bool = False) -> str:
    """The Chromium binary to launch; :class:`EnvConfigError` when there is none."""
    configured = os.environ.get(CHROMIUM_ENV_VAR)
    if configured:
        if not (os.path.isfile(configured) and os.access(configured, os.X_OK)):
            raise EnvConfigError(f"{CHROMIUM_ENV_VAR}={configured!r} is not an executable file")
        return configured
    for name in (HEADLESS_SHELL, *_CANDIDATES) if headless else _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise EnvConfigError(
        "no Chromium found: install Debian's `chromium-headless-shell` (headless) or "
        "`chromium` package, or set "
        f"{CHROMIUM_ENV_VAR} to a Chromium binary"
    )


async def launch_chromium(playwright: Playwright, *, headless: bool = True) -> Browser:
    """A fresh Chromium process driven by `playwright`."""
    return await playwright.chromium.launch(
        executable_path=chromium_executable(headless=headless),
        args=list(CHROMIUM_ARGS),
        headless=headless,
        # Playwright's own signal handlers would close the browser on SIGINT before the
        # env's cleanup runs; the pool closes its browsers itself.
        handle_sigint=False,
        handle_sigterm=False,
        handle_sighup=False,
    )
