"""Desktop tasks without a desktop: checkers over an in-memory shell, the oracle's
reading of instructions, registration, and the `desktop` spec's refusals."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from envs.base import ComputerAction, Message, Observation
from envs.desktop.checkers import Check, Checker, CommandOutput, FileContent
from envs.desktop.family import register as register_desktop_tasks
from envs.desktop.provider import CommandResult, DesktopShell
from envs.desktop.spec import DesktopEnvSpec
from envs.desktop.tasks import TASKS, oracle, task_names
from envs.registry import parse_spec


class MemoryShell:
    """A `DesktopShell` whose files and command outputs are dicts."""

    def __init__(self, files: dict[str, bytes], outputs: dict[str, str]) -> None:
        self.files, self.outputs = files, outputs

    async def run(self, command: str, timeout_s: float = 10.0) -> CommandResult:
        if command in self.outputs:
            return CommandResult(0, self.outputs[command], "")
        return CommandResult(1, "", "not found")

    async def read_file(self, path: str) -> bytes | None:
        return self.files.get(path)

    async def write_file(self, path: str, data: bytes) -> None:
        self.files[path] = data

    async def launch(self, argv: Sequence[str]) -> None:
        pass


def test_memory_shell_is_a_desktop_shell() -> None:
    assert isinstance(MemoryShell({}, {}), DesktopShell)


async def test_checks_fill_fields_and_combine() -> None:
    shell = MemoryShell({"note.txt": b"apple\n"}, {"ls projects": "apple\n"})
    file_check = Check("exact_match", FileContent("{name}.txt"), "{word}")
    filled = file_check.fill({"name": "note", "word": "apple"})
    assert filled.result == FileContent("note.txt")
    passed, reports = await Checker((filled,), grace_s=0).run(shell)
    assert passed and reports[0]["value"] == "apple\n"
    missing = Check("exact_match", CommandOutput("ls nowhere"), "apple")
    assert not (await Checker((filled, missing), "and", grace_s=0).run(shell))[0]
    assert (await Checker((filled, missing), "or", grace_s=0).run(shell))[0]
    with pytest.raises(ValueError, match="unknown metric"):
        Check("fuzzy", FileContent("a"), "b")


def first_observation(instruction: str) -> Observation:
    content = f"Instruction: {instruction}\nScreen: 1280x800."
    return Observation(messages=[Message(role="user", content=content)])


@pytest.mark.parametrize("name", task_names())
@pytest.mark.parametrize("seed", [0, 5])
def test_oracle_reads_every_instruction_back(name: str, seed: int) -> None:
    task = TASKS[name]
    fields = task.fields(seed)
    observations = [first_observation(task.instruction.format(**fields))]
    actions: list[ComputerAction] = []
    while not actions or actions[-1].action_type not in ("DONE", "FAIL"):
        actions.append(oracle(observations))
        observations.append(observations[0])
    assert actions[-1].action_type == ("DONE" if task.feasible else "FAIL")
    for value in fields.values():
        assert any(value in str(a.parameters) for a in actions)


def test_oracle_refuses_an_unknown_instruction() -> None:
    with pytest.raises(ValueError, match="no desktop task"):
        oracle([first_observation("Fly to the moon.")])


def test_registration() -> None:
    from envs import registry

    ids = register_desktop_tasks()
    try:
        assert ids == [f"desktop/{name}-v0" for name in task_names()]
        entry = registry.spec("desktop/terminal-echo-v0")
        assert entry.entry_point == "envs.desktop.env:make_env"
        assert entry.kwargs == {"task": "terminal-echo"}
        assert registry.oracle("desktop/terminal-echo-v0") is oracle
    finally:
        for env_id in ids:
            registry.unregister(env_id)


def test_spec_fields() -> None:
    spec = parse_spec("desktop", {"task": "desktop/terminal-echo-v0", "screen": [1024, 768]})
    assert isinstance(spec, DesktopEnvSpec) and spec.screen == (1024, 768)
    remote = parse_spec(
        "desktop",
        {
            "task": "desktop/make-directory-v0",
            "novnc_url": "http://127.0.0.1:6080/vnc.html?autoconnect=1",
            "state_url": "http://127.0.0.1:5000",
        },
    )
    assert str(remote.novnc_url).startswith("http://127.0.0.1:6080/")  # type: ignore[union-attr]
    view_only = {"task": "desktop/infeasible-photoshop-v0", "novnc_url": "http://127.0.0.1:1/"}
    assert parse_spec("desktop", view_only).kind == "desktop"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"task": "terminal-echo"}, "desktop task id"),
        ({"task": "desktop/no-such-task-v0"}, "no desktop task"),
        ({"task": "desktop/terminal-echo-v0", "screen": [100, 100]}, "between"),
        ({"task": "desktop/terminal-echo-v0", "screen": [1024]}, "screen"),
        ({"task": "desktop/terminal-echo-v0", "settle_ms": -1}, "settle_ms"),
        ({"task": "desktop/terminal-echo-v0", "state_url": "http://127.0.0.1:1"}, "set novnc_url"),
        (
            {"task": "desktop/terminal-echo-v0", "novnc_url": "http://127.0.0.1:1"},
            "needs state_url",
        ),
        ({"task": "desktop/terminal-echo-v0", "novnc_url": "ftp://x"}, "novnc_url"),
        ({"task": "desktop/terminal-echo-v0", "display": ":1"}, "display"),
    ],
)
def test_spec_refusals(spec: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        parse_spec("desktop", spec)
