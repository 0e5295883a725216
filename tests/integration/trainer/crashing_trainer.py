"""`python -m tests.integration.trainer.crashing_trainer POINT FROM ARGS...`: the
`agentflow ARGS...` command (`trainer CONFIG --gateway URL --run ID`), which kills its own
process with SIGKILL when the first step it trains from step FROM on reaches POINT, as a
crash there would. "The first step it trains" counts from where it resumes: a process
that resumes after the checkpoint of step 3 dies in step max(4, FROM).

The points, in the order the train loop passes them (trainer/loop.py):

    before_publish     the step is trained; its weights are not published
    before_metrics     published; no row in metrics.jsonl, none sent to the gateway
    mid_metrics        the row is in metrics.jsonl; the gateway has not got it
    before_checkpoint  both have it; no checkpoint covers the step
    before_ack         its checkpoint is on disk; its batch is not acknowledged
    before_next_step   acknowledged; the next step has not started

The loop's own functions are wrapped (nothing in the product knows of this), so a point
that the loop no longer passes leaves the process alive, which the test sees. Before it
dies it prints `crashing_trainer: SIGKILL at POINT of step N` (stderr).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

POINTS = (
    "before_publish",
    "before_metrics",
    "mid_metrics",
    "before_checkpoint",
    "before_ack",
    "before_next_step",
)

DYING = "crashing_trainer: SIGKILL at"


def install(point: str, first: int) -> None:
    """Wrap the loop's steps so that the first step this process trains from step `first`
    on dies at `point`.

    The step is known once the loop resumes: `trainer.loop.resume` returns the state the
    loop then advances in place, so each point reads the step from it. (A version is no
    step: a resumed trainer republishes its checkpoint's weights under a new version.)"""
    import trainer.loop as loop
    from trainer.report import RunReport
    from trainer.weights import SyncReport, WeightPublisher

    assert point in POINTS, point
    # `from trainer.loop import resume` in these takes the wrapper only if it comes first.
    assert "trainer.remote" not in sys.modules and "trainer.embedded" not in sys.modules
    resumed: dict[str, Any] = {}  # "state": the loop's state; "target": the step that dies
    checkpointing = {"step": 0}

    def at(where: str, step: int) -> bool:
        return point == where and "target" in resumed and step == resumed["target"]

    def die(step: int) -> None:
        print(f"{DYING} {point} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    resume = loop.resume

    async def resume_then(policy: Any, stream: Any, root: Path) -> tuple[Any, Path | None]:
        state, restored = await resume(policy, stream, root)
        resumed.update(state=state, target=max(state.step + 1, first))
        return state, restored

    publish = WeightPublisher.publish

    async def publish_then(
        self: WeightPublisher, state: Mapping[str, Any], version: int
    ) -> SyncReport:
        # The loop counts the step before it publishes; the republish at a resume comes
        # before the loop, a step short of the target.
        step = resumed["state"].step if "state" in resumed else 0
        if at("before_publish", step):
            die(step)
        report = await publish(self, state, version)
        if at("before_metrics", step):
            die(step)
        return report

    record = RunReport.record

    def record_then(self: RunReport, step: int, metrics: dict[str, float], **more: Any) -> None:
        record(self, step, metrics, **more)
        if at("mid_metrics", step):
            die(step)

    checkpoint_and_ack = loop.checkpoint_and_ack

    async def checkpoint_then(policy: Any, stream: Any, settings: Any, state: Any) -> None:
        if at("before_checkpoint", state.step):
            die(state.step)
        checkpointing["step"] = state.step
        await checkpoint_and_ack(policy, stream, settings, state)
        if at("before_next_step", state.step):
            die(state.step)

    ack_all = loop.ack_all

    async def ack_then(stream: Any, unacked: Any) -> int:
        # Also called by `resume`, for the batches of the checkpoint it restores: before
        # the target is set.
        if at("before_ack", checkpointing["step"]):
            die(checkpointing["step"])
        return await ack_all(stream, unacked)

    loop.resume = resume_then
    WeightPublisher.publish = publish_then  # type: ignore[method-assign,assignment]
    RunReport.record = record_then  # type: ignore[method-assign]
    loop.checkpoint_and_ack = checkpoint_then
    loop.ack_all = ack_then


def main() -> None:
    point, first, *args = sys.argv[1:]
    install(point, int(first))
    from trainer.cli import app

    app(args=args, prog_name="agentflow")


if __name__ == "__main__":
    main()
