"""The seam between desktop envs and whatever runs desktops.

A :class:`DesktopProvider` hands out :class:`Desktop` handles: the noVNC page a browser
drives, the screen size, and (when the provider can offer one) a :class:`DesktopShell`
through which task setup and checkers reach the desktop's state: run a command in its
session, read or write a file in its home, launch an app. The env never starts
processes itself, so the same env drives a local Xvfb (envs/desktop/local.py) or a VM
somewhere else (envs/desktop/remote.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@runtime_checkable
class DesktopShell(Protocol):
    """State access inside one desktop's session (its display, its home)."""

    async def run(self, command: str, timeout_s: float = 10.0) -> CommandResult:
        """Run `command` with `sh -c` in the session, cwd the home; its result."""
        ...

    async def read_file(self, path: str) -> bytes | None:
        """A file's bytes, `path` relative to the home (`~/` allowed); None if missing."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Write a file under the home (parents made)."""
        ...

    async def launch(self, argv: Sequence[str]) -> None:
        """Start an app in the session without waiting for it (it ends with the desktop)."""
        ...


@dataclass(frozen=True)
class Desktop:
    """One running desktop, as a provider handed it out."""

    id: str
    novnc_url: str  # the noVNC page, ready to connect (autoconnect, host and port set)
    screen: tuple[int, int] | None  # width, height; None: read from the page once connected
    shell: DesktopShell | None = None  # None: no state access (a VNC view only)
    display: str | None = None  # ":N" for a local X display
    vnc_port: int | None = None
    ws_port: int | None = None
    home: Path | None = None
    info: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class DesktopProvider(Protocol):
    async def start(self, screen: tuple[int, int]) -> Desktop:
        """A running desktop of that size (a provider that cannot choose ignores it)."""
        ...

    async def stop(self, desktop: Desktop) -> None:
        """End `desktop` and everything running in it; safe to call twice."""
        ...

    async def aclose(self) -> None:
        """Stop every desktop this provider started; later starts are refused."""
        ...
