"""A run directory: the config, per-step metrics (JSONL), a live progress line, and at
the end `summary.json` and a PNG plot of reward and episode length against step.

    runs/<name>/
      config.json          the validated run config
      metrics.jsonl        one JSON object per trainer step: its step, the weight version
                           it published, its metrics and the ids of the trajectories it
                           trained (`trajectory_ids`)
      errors.jsonl         steps that failed and were tried again (a teacher down)
      summary.json         first/last 10% mean reward, steps, time, where things are
      reward.png           reward and turns per episode against step
      checkpoints/step-N/  model, optimizer, step, version (see trainer.loop)
      sft/                 the warm-started model, when the run has a warm start
      tensorboard/, wandb/ the trackers the config's `logger` names (trainer.loggers)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from trainer.loggers import MetricLogger, log

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
ERRORS_FILE = "errors.jsonl"
PLOT_FILE = "reward.png"


class RunReport:
    def __init__(
        self,
        directory: Path,
        total_steps: int,
        *,
        out: TextIO | None = None,
        loggers: Sequence[MetricLogger] = (),
    ) -> None:
        self.directory = directory
        self.loggers = list(loggers)
        self.total_steps = total_steps
        self.out = out or sys.stdout
        self.started = time.perf_counter()
        self.first_step: int | None = None
        directory.mkdir(parents=True, exist_ok=True)
        self.metrics_path = directory / METRICS_FILE

    def write_config(self, config: dict[str, Any]) -> None:
        (self.directory / "config.json").write_text(json.dumps(config, indent=2))

    def record(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        version: int | None = None,
        trajectory_ids: Sequence[str] | None = None,
    ) -> None:
        """Append step `step`'s row (on disk when this returns); the trackers get `metrics`.

        `version`: the weight version the step published; `trajectory_ids`: what it trained.
        """
        row: dict[str, Any] = {"step": step}
        if version is not None:
            row["version"] = version
        row |= {"time": round(time.perf_counter() - self.started, 3), **metrics}
        if trajectory_ids is not None:
            row["trajectory_ids"] = list(trajectory_ids)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
            # The checkpoint written next counts on this row being on disk (trainer.loop).
            fh.flush()
            os.fsync(fh.fileno())
        if self.first_step is None:
            self.first_step = step
        for tracker in self.loggers:
            try:
                tracker.log(step, metrics)
            except Exception:  # a tracker is a copy: the run and metrics.jsonl go on
                log.exception("logging step %d to %s failed", step, type(tracker).__name__)
        self._progress(step, metrics)

    def error(self, step: int, message: str) -> None:
        """A step that failed and will be tried again (the run goes on)."""
        row = {"step": step, "time": round(time.perf_counter() - self.started, 3), "error": message}
        with (self.directory / ERRORS_FILE).open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(
            f"step {step:>4}/{self.total_steps}  failed, trying again: {message}",
            file=self.out,
            flush=True,
        )

    def _progress(self, step: int, m: dict[str, float]) -> None:
        elapsed = time.perf_counter() - self.started
        done = step - (self.first_step or step) + 1
        per_step = elapsed / max(done, 1)
        eta = per_step * (self.total_steps - step)
        line = (
            f"step {step:>4}/{self.total_steps}  reward {m.get('reward', math.nan):.3f}  "
            f"turns {m.get('turns', math.nan):.2f}  staleness {m.get('staleness_mean', 0):.2f}  "
            f"{m.get('tokens_per_s', 0):,.0f} train tok/s  {per_step:.1f} s/step  "
            f"ETA {_clock(eta)}"
        )
        print(line, file=self.out, flush=True)

    def rows(self) -> list[dict[str, Any]]:
        """One row per step, in step order (the latest row of a step written twice)."""
        if not self.metrics_path.exists():
            return []
        by_step: dict[int, dict[str, Any]] = {}
        text = self.metrics_path.read_text()
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:  # a write cut short at the end: never finished
                    continue
                raise
            by_step[int(row["step"])] = row
        return [by_step[s] for s in sorted(by_step)]

    def keep_through(self, step: int) -> int:
        """Drop the rows of steps after `step`, the checkpoint a trainer resumes from, and
        any second row of a step; returns how many rows were dropped.

        Those steps are done again after the resume (their batches were never
        acknowledged), each writing its row anew: without this, the file would hold
        two rows for each. The file is replaced whole (a temporary file renamed into
        place), so a trainer killed meanwhile finds either version, and drops again.
        """
        if not self.metrics_path.exists():
            return 0
        lines = sum(1 for line in self.metrics_path.read_text().splitlines() if line)
        kept = [row for row in self.rows() if int(row["step"]) <= step]
        if len(kept) == lines:
            return 0
        temporary = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        with temporary.open("w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, self.metrics_path)
        return lines - len(kept)

    def close(self) -> None:
        """Close the trackers (idempotent); the files stay."""
        loggers, self.loggers = self.loggers, []
        for tracker in loggers:
            try:
                tracker.close()
            except Exception:
                log.exception("closing %s failed", type(tracker).__name__)

    def finish(self, extra: dict[str, Any]) -> dict[str, Any]:
        self.close()
        rows = self.rows()
        summary = {**summarize(rows), **extra}
        (self.directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        try:
            plot(rows, self.directory / PLOT_FILE)
            summary["plot"] = str(self.directory / PLOT_FILE)
        except ImportError as exc:  # the plot is a convenience; the numbers are in JSON
            summary["plot"] = f"not drawn: {exc}"
        (self.directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        return summary


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean reward over the first and the last 10% of steps (at least one step each)."""
    rewards = [float(r["reward"]) for r in rows if "reward" in r]
    if not rewards:
        return {"steps": 0}
    tenth = max(1, len(rewards) // 10)
    first = sum(rewards[:tenth]) / tenth
    last = sum(rewards[-tenth:]) / tenth
    turns = [float(r["turns"]) for r in rows if "turns" in r]
    return {
        "steps": len(rows),
        "first_step": rows[0]["step"],
        "last_step": rows[-1]["step"],
        "reward_first_10pct": round(first, 4),
        "reward_last_10pct": round(last, 4),
        "reward_gain": round(last - first, 4),
        "mean_turns": round(sum(turns) / len(turns), 3) if turns else None,
        "seconds": rows[-1].get("time"),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r.get("reward") for r in rows], lw=0.8, alpha=0.5, label="batch")
    top.plot(steps, _smooth([r.get("reward", 0.0) for r in rows]), lw=2, label="smoothed")
    top.set_ylabel("mean reward")
    top.legend(loc="lower right")
    bottom.plot(steps, [r.get("turns") for r in rows], color="tab:green")
    bottom.set_ylabel("turns per episode")
    bottom.set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"
