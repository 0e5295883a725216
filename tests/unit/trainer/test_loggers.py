"""Trackers: numbers only (non-finite values and text left out), an offline wandb run
on disk, and a clear refusal of a tracker that is not installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentflow.errors import InvalidInput
from trainer.loggers import build_loggers
from trainer.report import RunReport


def test_tensorboard_gets_the_finite_numbers(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = RunReport(tmp_path, 2, loggers=build_loggers(["tensorboard"], tmp_path, "r", {}))
    report.record(1, {"reward": 0.25, "kl": float("nan"), "note": "x", "done": True})  # type: ignore[dict-item]
    report.record(2, {"reward": 0.5, "kl": 0.1})
    report.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]
    assert [e.step for e in events.Scalars("kl")] == [2]
    assert set(events.Tags()["scalars"]) == {"reward", "kl"}


def test_wandb_writes_an_offline_run(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb")
    loggers = build_loggers(["wandb"], tmp_path, "offline-test", {"seed": 3})
    try:
        loggers[0].log(1, {"reward_of_the_step": 0.75})
    finally:
        loggers[0].close()
        wandb.teardown()  # the local service process ends with the test
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"reward_of_the_step" in run_file.read_bytes()


def test_a_missing_tracker_is_refused_before_the_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    with pytest.raises(InvalidInput) as err:
        build_loggers(["tensorboard"], tmp_path, "r", {})
    assert err.value.field == ("logger",) and "agentflow[track]" in err.value.message
