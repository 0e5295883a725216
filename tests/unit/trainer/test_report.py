"""`RunReport`'s metrics.jsonl across a resume: the rows of steps after the checkpoint are
dropped (the resumed trainer does those steps again), so no step has two rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

from trainer.report import METRICS_FILE, RunReport


def _lines(directory: Path) -> list[dict[str, object]]:
    text = (directory / METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_a_row_names_its_version_and_trajectories(tmp_path: Path) -> None:
    report = RunReport(tmp_path, 3, out=io.StringIO())
    report.record(1, {"reward": 0.5}, version=7, trajectory_ids=["a", "b"])
    (row,) = _lines(tmp_path)
    assert row["step"] == 1 and row["version"] == 7 and row["reward"] == 0.5
    assert row["trajectory_ids"] == ["a", "b"]


def test_a_resume_keeps_the_rows_through_its_checkpoint(tmp_path: Path) -> None:
    report = RunReport(tmp_path, 5, out=io.StringIO())
    for step in (1, 2, 3, 3, 4):  # step 3 twice: a file written before rows were dropped
        report.record(step, {"reward": float(step)}, version=step)
    with (tmp_path / METRICS_FILE).open("a") as fh:
        fh.write('{"step": 5, "rew')  # a write cut short by the kill

    resumed = RunReport(tmp_path, 5, out=io.StringIO())
    assert resumed.keep_through(3) == 3  # the second row of 3, 4, and the cut one
    assert [row["step"] for row in _lines(tmp_path)] == [1, 2, 3]
    assert resumed.keep_through(3) == 0  # nothing more to drop
    resumed.record(4, {"reward": 40.0}, version=9)
    assert [(row["step"], row["version"]) for row in resumed.rows()] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 9),
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_resume_without_a_checkpoint_starts_the_rows_over(tmp_path: Path) -> None:
    report = RunReport(tmp_path, 2, out=io.StringIO())
    report.record(1, {"reward": 1.0})
    assert RunReport(tmp_path, 2, out=io.StringIO()).keep_through(0) == 1
    assert (tmp_path / METRICS_FILE).read_text() == ""
