"""`agentflow trainer CONFIG --gateway URL --run ID`: the split form's trainer.

The gateway executes the run (engines, envs, agents, database); this process leases
trajectories over HTTP, trains, and publishes each version with `disk` sync: a
safetensors directory the gateway's engines load (it must be readable at the same path
there). The loop, checkpoints and acknowledgement rules are the embedded ones.

What this process form cannot do is refused before anything starts, naming the field:
any sync but `disk`, the warm start (the gateway builds its engine from `model`, so run
`agentflow sft` first and point `model.path` at its output), a CUDA device this machine
lacks, and a config that disagrees with the run's on what both sides use (the starting
model, the sampling temperature the log-probs are taken at, the group size, the batch the
gateway's staleness gate admits episodes for).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentflow.client import AsyncClient
from agentflow.errors import InvalidInput
from agentflow.rollout.stream import HttpTrajectoryStream
from agentflow.run_config import RunConfig, check_device
from trainer.loop import resume, summarize_batch, train
from trainer.report import RunReport
from trainer.setup import build_policy, loop_settings
from trainer.weights import GatewayWeightTarget, WeightPublisher

# What the gateway's run and this trainer both use, so must agree on (the model's seed only
# matters when it is built from `model.init`).
_SHARED: tuple[tuple[str, ...], ...] = (
    ("model",),
    ("seed",),
    ("agent", "temperature"),
    ("rollout", "group_size"),
    ("trainer", "batch_episodes"),
)


def train_remote(
    config: RunConfig, gateway: str, run_id: uuid.UUID, *, api_key: str | None = None
) -> dict[str, Any]:
    check_split_form(config)
    if config.trainer.threads:
        import torch

        torch.set_num_threads(config.trainer.threads)
    return asyncio.run(_train(config, gateway.rstrip("/"), run_id, api_key))


def check_split_form(config: RunConfig) -> None:
    """Refuse, naming the field, what a trainer in its own process cannot do."""
    if config.weights.sync != "disk":
        raise InvalidInput(
            f"a trainer in its own process publishes with disk sync, not {config.weights.sync!r}",
            field=("weights", "sync"),
        )
    if config.warm_start.enabled:
        raise InvalidInput(
            "the split trainer does not run the warm start (the gateway's engine starts from "
            "`model`): run `agentflow sft CONFIG` first and set model.path to its output",
            field=("warm_start", "enabled"),
        )
    check_device(config.trainer.device, ("trainer", "device"))


def check_same_run(config: RunConfig, stored: dict[str, Any], run_id: uuid.UUID) -> None:
    """This trainer's config must agree with the run's on what both sides use."""
    mine = config.model_dump(mode="json")
    for path in _SHARED:
        if path == ("seed",) and config.model.path:
            continue
        here, there = _at(mine, path), _at(stored, path)
        if there is not None and here != there:
            raise InvalidInput(
                f"{here!r} here but {there!r} in run {run_id}'s config on the gateway; "
                "the trainer must agree with the run it trains",
                field=path,
            )


def _at(document: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = document
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


async def _train(
    config: RunConfig, gateway: str, run_id: uuid.UUID, api_key: str | None
) -> dict[str, Any]:
    directory = Path(config.trainer.run_dir) / config.name
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with AsyncClient(gateway, api_key=api_key) as api:
        run = await api.get_run(run_id)  # NotFound, Unauthorized: named errors
    check_same_run(config, run.config, run_id)
    async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=120) as client:
        report = RunReport(directory, config.trainer.steps)
        stream = HttpTrajectoryStream(client, run_id)
        policy = build_policy(config)
        checkpoints = directory / "checkpoints"
        state, restored = await resume(policy, stream, checkpoints)
        target = GatewayWeightTarget(gateway, run_id, api_key)
        weights_dir = Path(config.weights.dir) if config.weights.dir else directory / "weights"
        publisher = WeightPublisher(
            "disk", [target], weights_dir.resolve(), config=policy.model.config
        )
        if restored is not None:
            state.version = max(state.version, run.weight_version) + 1
            await publisher.publish(policy.state_dict(), state.version)
        else:
            state.version = run.weight_version

        async def on_step(step: int, metrics: dict[str, float], batch: Any) -> None:
            report.record(step, {**summarize_batch(batch, state.version - 1), **metrics})

        settings = loop_settings(config, checkpoints)
        try:
            await train(policy, stream, publisher, settings, state, on_step=on_step)
        finally:
            await target.aclose()
    return report.finish({"run": config.name, "run_id": str(run_id), "gateway": gateway})
