"""`agentflow trainer CONFIG --gateway URL --run ID`: the split form's trainer.

The gateway executes the run (engines, envs, agents, database); this process leases
trajectories over HTTP, trains, and publishes each version with `disk` sync: a
safetensors directory the gateway's engines load (it must be readable at the same path
there). The loop, checkpoints and acknowledgement rules are the embedded ones.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentflow.errors import InvalidInput
from agentflow.rollout.stream import HttpTrajectoryStream
from agentflow.run_config import RunConfig
from trainer.loop import resume, summarize_batch, train
from trainer.report import RunReport
from trainer.setup import build_policy, loop_settings
from trainer.weights import GatewayWeightTarget, WeightPublisher


def train_remote(
    config: RunConfig, gateway: str, run_id: uuid.UUID, *, api_key: str | None = None
) -> dict[str, Any]:
    if config.weights.sync != "disk":
        raise InvalidInput(
            "a trainer in its own process publishes with disk sync", field=("weights", "sync")
        )
    return asyncio.run(_train(config, gateway.rstrip("/"), run_id, api_key))


async def _train(
    config: RunConfig, gateway: str, run_id: uuid.UUID, api_key: str | None
) -> dict[str, Any]:
    directory = Path(config.trainer.run_dir) / config.name
    report = RunReport(directory, config.trainer.steps)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=120) as client:
        stream = HttpTrajectoryStream(client, run_id)
        policy = build_policy(config)
        checkpoints = directory / "checkpoints"
        state, restored = await resume(policy, stream, checkpoints)
        run = (await client.get(f"/v1/runs/{run_id}")).json()
        target = GatewayWeightTarget(gateway, run_id, api_key)
        weights_dir = Path(config.weights.dir) if config.weights.dir else directory / "weights"
        publisher = WeightPublisher(
            "disk", [target], weights_dir.resolve(), config=policy.model.config
        )
        if restored is not None:
            state.version = max(state.version, int(run.get("weight_version", 0))) + 1
            await publisher.publish(policy.state_dict(), state.version)
        else:
            state.version = int(run.get("weight_version", 0))

        async def on_step(step: int, metrics: dict[str, float], batch: Any) -> None:
            report.record(step, {**summarize_batch(batch, state.version - 1), **metrics})

        settings = loop_settings(config, checkpoints)
        try:
            await train(policy, stream, publisher, settings, state, on_step=on_step)
        finally:
            await target.aclose()
    return report.finish({"run": config.name, "run_id": str(run_id), "gateway": gateway})
