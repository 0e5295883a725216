"""Experiment trackers the step metrics also go to, chosen by the run's `logger` list.

    tensorboard   event files under runs/<name>/tensorboard (`tensorboard --logdir runs`)
    wandb         an offline Weights & Biases run under runs/<name>/wandb
                  (`wandb sync runs/<name>/wandb/offline-run-*` uploads it later)

`metrics.jsonl` is always written; a tracker is an extra copy. Both need the `track`
extra (`pip install 'agentflow[track]'`): a run that asks for one without it is refused
before it starts. Nothing here reaches the network: wandb runs in offline mode.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from agentflow.errors import InvalidInput

LoggerName = Literal["tensorboard", "wandb"]
log = logging.getLogger(__name__)


class MetricLogger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among `metrics` (trackers plot scalars)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardLogger:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise InvalidInput(
                f"logger 'tensorboard' needs tensorboard ({exc}): pip install 'agentflow[track]'",
                field="logger",
            ) from None
        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in _numbers(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    def __init__(self, directory: Path, run_name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise InvalidInput(
                f"logger 'wandb' needs wandb ({exc}): pip install 'agentflow[track]'",
                field="logger",
            ) from None
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project="agentflow",
            name=run_name,
            dir=str(directory),
            config=dict(config),
            mode="offline",  # never the network; `wandb sync` uploads it later
            reinit="create_new",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def build_loggers(
    names: Sequence[LoggerName], directory: Path, run_name: str, config: Mapping[str, Any]
) -> list[MetricLogger]:
    loggers: list[MetricLogger] = []
    try:
        for name in names:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(directory / "tensorboard"))
            elif name == "wandb":
                loggers.append(WandbLogger(directory, run_name, config))
    except BaseException:
        for made in loggers:
            made.close()
        raise
    return loggers
