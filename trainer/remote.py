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

Every call to the gateway goes through a `RetryingTransport`: a gateway that restarts
within the retry window (`--retry-window-s`) costs this process waits, not its state;
one that stays away ends it with `GatewayUnavailable`. docs/training.md ("When the
gateway goes away") says why each call is safe to send again.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentflow.client import AsyncClient, GatewayUnavailable, RetryingTransport, RetryPolicy
from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.inference.base import WeightUpdate
from agentflow.rollout.stream import HttpTrajectoryStream
from agentflow.run_config import RunConfig, check_device
from trainer.loop import resume, summarize_batch, train
from trainer.report import RunReport
from trainer.setup import build_policy, loop_settings
from trainer.weights import GatewayWeightTarget, WeightPublisher, WeightSyncError

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
    config: RunConfig,
    gateway: str,
    run_id: uuid.UUID,
    *,
    api_key: str | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """`retry`: how long each call waits out a gateway that went away (default 5 min)."""
    check_split_form(config)
    if config.trainer.threads:
        import torch

        torch.set_num_threads(config.trainer.threads)
    return asyncio.run(_train(config, gateway.rstrip("/"), run_id, api_key, retry or RetryPolicy()))


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


class RepeatablePublish:
    """A `GatewayWeightTarget` whose publish may be sent twice.

    The gateway refuses a version it already serves (not newer; a duplicate row), so a
    publish resent because its answer was lost would fail although it went through.
    When a publish is refused, the run's recorded versions decide: this very version at
    this very directory means it is live.
    """

    def __init__(self, target: GatewayWeightTarget, http: httpx.AsyncClient, run_id: str):
        """`http`: a client of the same gateway (its base URL and key) for the check."""
        self.target = target
        self.name = target.name
        self._http = http
        self._run_id = run_id
        self.gave_up: GatewayUnavailable | None = None  # why the last publish failed

    async def update_weights(self, update: WeightUpdate) -> int:
        try:
            return await self.target.update_weights(update)
        except GatewayUnavailable as exc:  # the publisher reports it inside a WeightSyncError
            self.gave_up = exc
            raise
        except AgentFlowError:
            if update.version is not None and await self._recorded(update):
                return update.version
            raise

    async def _recorded(self, update: WeightUpdate) -> bool:
        try:
            response = await self._http.get(f"/v1/runs/{self._run_id}/metrics")
        except GatewayUnavailable as exc:
            self.gave_up = exc
            raise
        if response.is_error:
            return False
        return any(
            v["version"] == update.version and v["uri"] == update.path
            for v in response.json()["versions"]
        )


async def _train(
    config: RunConfig, gateway: str, run_id: uuid.UUID, api_key: str | None, retry: RetryPolicy
) -> dict[str, Any]:
    directory = Path(config.trainer.run_dir) / config.name
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with AsyncClient(gateway, api_key=api_key, transport=RetryingTransport(retry)) as api:
        run = await api.get_run(run_id)  # NotFound, Unauthorized: named errors
    check_same_run(config, run.config, run_id)
    async with httpx.AsyncClient(
        base_url=gateway, headers=headers, timeout=120, transport=RetryingTransport(retry)
    ) as client:
        report = RunReport(directory, config.trainer.steps)
        stream = HttpTrajectoryStream(client, run_id)
        policy = build_policy(config)
        checkpoints = directory / "checkpoints"
        state, restored = await resume(policy, stream, checkpoints)
        weights_api = AsyncClient(
            gateway, api_key=api_key, timeout_s=1800.0, transport=RetryingTransport(retry)
        )
        target = GatewayWeightTarget(gateway, run_id, api_key, client=weights_api)
        published = RepeatablePublish(target, client, str(run_id))
        weights_dir = Path(config.weights.dir) if config.weights.dir else directory / "weights"
        publisher = WeightPublisher(
            "disk", [published], weights_dir.resolve(), config=policy.model.config
        )

        async def on_step(step: int, metrics: dict[str, float], batch: Any) -> None:
            report.record(step, {**summarize_batch(batch, state.version - 1), **metrics})

        settings = loop_settings(config, checkpoints)
        try:
            if restored is not None:
                state.version = max(state.version, run.weight_version) + 1
                await publisher.publish(policy.state_dict(), state.version)
            else:
                state.version = run.weight_version
            await train(policy, stream, publisher, settings, state, on_step=on_step)
        except WeightSyncError:
            if published.gave_up is not None:  # one line, not the publisher's wrapping
                raise published.gave_up from None
            raise
        finally:
            await weights_api.aclose()
    return report.finish({"run": config.name, "run_id": str(run_id), "gateway": gateway})
