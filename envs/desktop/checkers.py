"""Task checkers in OSWorld's shape: a metric (`func`) over a `result` getter and an
`expected` value, several of them joined by `and`/`or`.

Getters read the desktop's state through its :class:`DesktopShell` (a file in its home,
a command's output, window titles from `xdotool`); metrics compare text. A checker
retries for a short grace period while it fails, because what the last action started
(a window mapping, a shell writing its file) may land just after the screen settled;
a pass is never delayed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from envs.desktop.provider import DesktopShell


class Getter(Protocol):
    """Reads one value of the desktop's state; its text may hold `{field}` templates."""

    async def __call__(self, shell: DesktopShell) -> str | None: ...

    def fill(self, fields: dict[str, str]) -> Getter: ...


@dataclass(frozen=True)
class FileContent:
    """The text of a file in the desktop's home (None when it does not exist)."""

    path: str

    async def __call__(self, shell: DesktopShell) -> str | None:
        data = await shell.read_file(self.path)
        return None if data is None else data.decode(errors="replace")

    def fill(self, fields: dict[str, str]) -> FileContent:
        return FileContent(self.path.format(**fields))


@dataclass(frozen=True)
class CommandOutput:
    """What `command` prints in the desktop's session (None when it fails)."""

    command: str

    async def __call__(self, shell: DesktopShell) -> str | None:
        result = await shell.run(self.command)
        return result.stdout if result.ok else None

    def fill(self, fields: dict[str, str]) -> CommandOutput:
        return CommandOutput(self.command.format(**fields))


def active_window_title() -> CommandOutput:
    return CommandOutput("xdotool getactivewindow getwindowname")


def window_titles() -> CommandOutput:
    """The titles of every visible window, one a line."""
    return CommandOutput("xdotool search --onlyvisible --name . getwindowname %@")


METRICS: dict[str, Callable[[str | None, str], bool]] = {
    "exact_match": lambda result, expected: result is not None and result.strip() == expected,
    "contains": lambda result, expected: result is not None and expected in result,
    "any_line_equals": lambda result, expected: (
        result is not None and expected in (line.strip() for line in result.splitlines())
    ),
}


@dataclass(frozen=True)
class Check:
    func: str  # a key of METRICS
    result: Getter
    expected: str

    def __post_init__(self) -> None:
        if self.func not in METRICS:
            raise ValueError(f"unknown metric {self.func!r}; expected one of {sorted(METRICS)}")

    def fill(self, fields: dict[str, str]) -> Check:
        """This check for one episode: `{field}` templates filled from its seed."""
        return Check(self.func, self.result.fill(fields), self.expected.format(**fields))

    async def evaluate(self, shell: DesktopShell) -> dict[str, Any]:
        value = await self.result(shell)
        return {
            "func": self.func,
            "result": repr(self.result),
            "value": value if value is None else value[:200],
            "expected": self.expected,
            "passed": METRICS[self.func](value, self.expected),
        }


@dataclass(frozen=True)
class Checker:
    checks: tuple[Check, ...]
    conj: Literal["and", "or"] = "and"
    grace_s: float = 1.5

    async def run(self, shell: DesktopShell) -> tuple[bool, list[dict[str, Any]]]:
        """Whether the desktop passes, and what each check read (for `info`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while True:
            reports = [await check.evaluate(shell) for check in self.checks]
            verdicts = [r["passed"] for r in reports]
            passed = all(verdicts) if self.conj == "and" else any(verdicts)
            if passed or loop.time() >= deadline:
                return passed, reports
            await asyncio.sleep(0.1)
