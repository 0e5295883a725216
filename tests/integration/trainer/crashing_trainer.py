"""`python -m tests.integration.trainer.crashing_trainer POINT STEP ARGS...`: the
`agentflow ARGS...` command (`trainer CONFIG --gateway URL --run ID`), which kills its own
process with SIGKILL when step STEP of a fresh start reaches POINT, as a crash there would.

The points, in the order the train loop passes them (trainer/loop.py):

    before_publish     the step is trained; its weights are not published
    before_metrics     published; no row in metrics.jsonl, none sent to the gateway
    mid_metrics        the row is in metrics.jsonl; the gateway has not got it
    before_checkpoint  both have it; no checkpoint covers the step
    before_ack         its checkpoint is on disk; its batch is not acknowledged
    before_next_step   acknowledged; the next step has not started

The loop's own functions are wrapped (nothing in the product knows of this), so a point
that the loop no longer passes leaves the process alive, which the test sees.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

POINTS = (
    "before_publish",
    "before_metrics",
    "mid_metrics",
    "before_checkpoint",
    "before_ack",
    "before_next_step",
)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int) -> None:
    """Wrap the loop's steps so that step `step` dies at `point`. A fresh start publishes
    version N at step N (the run serves version 0), which is how a publish knows its step."""
    import trainer.loop as loop
    from trainer.report import RunReport
    from trainer.weights import SyncReport, WeightPublisher

    assert point in POINTS, point
    checkpointing = {"step": 0}

    publish = WeightPublisher.publish

    async def publish_then(
        self: WeightPublisher, state: Mapping[str, Any], version: int
    ) -> SyncReport:
        if point == "before_publish" and version == step:
            _die()
        report = await publish(self, state, version)
        if point == "before_metrics" and version == step:
            _die()
        return report

    record = RunReport.record

    def record_then(self: RunReport, at: int, metrics: dict[str, float], **more: Any) -> None:
        record(self, at, metrics, **more)
        if point == "mid_metrics" and at == step:
            _die()

    checkpoint_and_ack = loop.checkpoint_and_ack

    async def checkpoint_then(policy: Any, stream: Any, settings: Any, state: Any) -> None:
        if point == "before_checkpoint" and state.step == step:
            _die()
        checkpointing["step"] = state.step
        await checkpoint_and_ack(policy, stream, settings, state)
        if point == "before_next_step" and state.step == step:
            _die()

    ack_all = loop.ack_all

    async def ack_then(stream: Any, unacked: Any) -> int:
        if point == "before_ack" and checkpointing["step"] == step:
            _die()
        return await ack_all(stream, unacked)

    WeightPublisher.publish = publish_then  # type: ignore[method-assign,assignment]
    RunReport.record = record_then  # type: ignore[method-assign,assignment]
    loop.checkpoint_and_ack = checkpoint_then
    loop.ack_all = ack_then


def main() -> None:
    point, step, *args = sys.argv[1:]
    install(point, int(step))
    from trainer.cli import app

    app(args=args, prog_name="agentflow")


if __name__ == "__main__":
    main()
