"""Desktop tasks: a seeded instruction, a setup, a checker, and a scripted solution.

Every task starts from the same desktop: a terminal (xterm titled `Terminal`) at the
top left, its shell in the desktop's home. Instructions are templates whose fields come
from the seed (`'{word}'`); the oracle reads those fields back from the instruction an
agent sees and plays the task's solution through the same computer actions an agent
sends (a click into the terminal at :data:`TERMINAL_POINT`, typing, DONE).

Infeasible tasks (OSWorld's convention) have no checker: they pass only when the
episode's last action is FAIL. Feasible ones fail on FAIL and are checked on DONE.

This module imports neither Playwright nor the registry: the desktop family
(envs/desktop/family.py) registers an env id per task.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.base import ComputerAction, EnvConfigError, Observation
from envs.desktop.checkers import (
    Check,
    Checker,
    CommandOutput,
    FileContent,
    active_window_title,
    window_titles,
)
from envs.desktop.provider import Desktop

TERMINAL_TITLE = "Terminal"
TERMINAL_ARGV = (
    *("xterm", "-T", TERMINAL_TITLE, "-geometry", "80x20+0+0"),
    *("-fa", "DejaVu Sans Mono", "-fs", "11"),
)
TERMINAL_POINT = (120, 120)  # inside the terminal on any screen of at least 320x240
MAX_EPISODE_STEPS = 15
_WORDS = ("hello", "apple", "river", "orbit", "maple", "delta", "cobalt", "lantern")
_FIELD = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class DesktopTask:
    name: str
    instruction: str  # a template over `choices`' fields
    solution: tuple[tuple[str, dict[str, Any]], ...]  # (action_type, parameters) templates
    checks: tuple[Check, ...] = ()  # over the filled fields, see `checker`
    conj: str = "and"
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reset_command: str = ""  # clears what an earlier episode left on a reused desktop

    @property
    def feasible(self) -> bool:
        return bool(self.checks)

    def fields(self, seed: int) -> dict[str, str]:
        return {name: options[seed % len(options)] for name, options in self.choices.items()}

    def checker(self, fields: dict[str, str]) -> Checker:
        return Checker(
            tuple(check.fill(fields) for check in self.checks),
            "or" if self.conj == "or" else "and",
        )

    async def setup(self, desktop: Desktop, seed: int) -> tuple[str, dict[str, str]]:
        """Prepare the desktop for episode `seed`; the instruction and its fields."""
        fields = self.fields(seed)
        if desktop.shell is None:
            if self.feasible:
                raise EnvConfigError(f"task {self.name!r} needs a desktop with state access")
        else:
            if self.reset_command:
                await desktop.shell.run(self.reset_command)
            await desktop.shell.launch(TERMINAL_ARGV)
            found = await desktop.shell.run(
                f"xdotool search --sync --onlyvisible --name '^{TERMINAL_TITLE}$'", timeout_s=20
            )
            if not found.ok:
                raise EnvConfigError(f"the terminal did not appear: {found.stderr.strip()}")
        return self.instruction.format(**fields), fields

    def parse(self, instruction: str) -> dict[str, str] | None:
        """The fields of an instruction made from this task's template, or None."""
        pattern, seen = "", set()
        for i, part in enumerate(_FIELD.split(self.instruction)):  # literal, field, literal...
            if i % 2 == 0:
                pattern += re.escape(part)
            else:
                pattern += f"(?P={part})" if part in seen else f"(?P<{part}>[\\w.-]+)"
                seen.add(part)
        match = re.fullmatch(pattern, instruction, flags=re.DOTALL)
        return None if match is None else match.groupdict()

    def solve(self, fields: dict[str, str], step: int) -> ComputerAction:
        action_type, params = self.solution[min(step, len(self.solution) - 1)]
        filled = {k: v.format(**fields) if isinstance(v, str) else v for k, v in params.items()}
        return ComputerAction(action_type=action_type, parameters=filled)  # type: ignore[arg-type]


_CLICK = ("CLICK", {"x": TERMINAL_POINT[0], "y": TERMINAL_POINT[1]})

TASKS: dict[str, DesktopTask] = {
    task.name: task
    for task in (
        DesktopTask(
            name="terminal-echo",
            instruction="In the terminal, write the word '{word}' into the file ~/note.txt "
            "(type `echo {word} > ~/note.txt` and press Enter), then answer DONE.",
            solution=(_CLICK, ("TYPING", {"text": "echo {word} > ~/note.txt\n"}), ("DONE", {})),
            checks=(Check("exact_match", FileContent("note.txt"), "{word}"),),
            choices={"word": _WORDS},
            reset_command="rm -f ~/note.txt",
        ),
        DesktopTask(
            name="window-title",
            instruction="Open a new terminal window titled '{title}' (run `xterm -T {title} &` "
            "in the terminal), then answer DONE.",
            solution=(_CLICK, ("TYPING", {"text": "xterm -T {title} &\n"}), ("DONE", {})),
            checks=(
                Check("exact_match", active_window_title(), "{title}"),
                Check("any_line_equals", window_titles(), "{title}"),
            ),
            conj="or",
            choices={"title": ("Notes", "Build", "Logs", "Scratch")},
        ),
        DesktopTask(
            name="make-directory",
            instruction="Create the directory ~/projects/{name} and nothing else in "
            "~/projects (for example with `mkdir -p ~/projects/{name}`), then answer DONE.",
            solution=(_CLICK, ("TYPING", {"text": "mkdir -p ~/projects/{name}\n"}), ("DONE", {})),
            checks=(
                Check("exact_match", CommandOutput("test -d projects/{name} && echo yes"), "yes"),
                Check("exact_match", CommandOutput("ls projects"), "{name}"),
            ),
            choices={"name": _WORDS},
            reset_command="rm -rf ~/projects",
        ),
        DesktopTask(
            name="infeasible-photoshop",
            instruction="Open Adobe Photoshop and create a new 800x600 canvas. If this "
            "cannot be done on this desktop, answer FAIL.",
            solution=(("FAIL", {}),),
        ),
    )
}


def task_names() -> list[str]:
    return sorted(TASKS)


def get_task(name: str) -> DesktopTask:
    try:
        return TASKS[name]
    except KeyError:
        raise EnvConfigError(f"no desktop task {name!r}; expected one of {task_names()}") from None


def instruction_of(observation: Observation) -> str:
    """The instruction line of a desktop env's observation message."""
    content = observation.messages[0].content if observation.messages else ""
    first = content.splitlines()[0] if content else ""
    return first.removeprefix("Instruction: ")


def oracle(observations: Sequence[Observation]) -> ComputerAction:
    """The scripted player of every desktop task: the next action of its solution."""
    if not observations:
        raise ValueError("the oracle needs the episode's first observation")
    instruction = instruction_of(observations[0])
    for task in TASKS.values():
        fields = task.parse(instruction)
        if fields is not None:
            return task.solve(fields, len(observations) - 1)
    raise ValueError(f"no desktop task has the instruction {instruction!r}")
