"""`agentflow train CONFIG --ray ADDRESS`: the run placed on a Ray cluster (docs/ray.md).

This process is the controller: it runs the warm start (when the run has one), then the
gateway (the run's database, scheduler, envs and agents), serving its API where the
cluster can reach it. The parts that scale out are Ray actors:
- the inference engines, `placement.engines` of them behind the gateway, routed by
  session and replaced when they die (`agentflow.placement.engines`);
- the env servers, with `placement.env_servers` (`agentflow.placement.env_servers`);
- the trainer's ranks, `trainer.ranks` actors in one placement group: each runs the split
  trainer (`trainer.remote`) against the gateway, and with several ranks they form the
  same process group torchrun would (rank 0 leases, publishes and checkpoints).
Weights go from the trainer to the engines as safetensors directories (disk sync) under
the run directory, which every node must see at the same path (a shared file system; on
one machine it is just the disk). Rerunning the command resumes: the gateway restarts
the open run of this name and the trainer its newest checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.ports import free_port
from agentflow.run_config import RunConfig

_TRAINER_READY_S = 600.0


class TrainerRank:
    """The body of one trainer-rank actor: the split trainer, as rank `rank` of `world`."""

    def __init__(self, rank: int, world: int, master: tuple[str, int] | None) -> None:
        if master is not None:  # a process group: several ranks, or the Megatron backend
            # What torchrun would set; each rank holds its own GPU (Ray sets
            # CUDA_VISIBLE_DEVICES), so its local device is the first it sees.
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR=master[0],
                MASTER_PORT=str(master[1]),
            )
        self.rank = rank

    def train(self, config_document: dict[str, Any], gateway: str) -> dict[str, Any]:
        from transformers.utils import logging as hf_logging

        from trainer.remote import train_remote

        hf_logging.disable_progress_bar()
        config = RunConfig.model_validate(config_document)
        return train_remote(config, gateway)


def placed_config(config: RunConfig, address: str | None) -> RunConfig:
    """The run as it is placed: `address` (if given) as `placement.ray`, every path
    absolute (actors do not share this process's working directory), and disk sync (the
    trainer is another process)."""
    placement = config.placement
    if address is not None:
        placement = placement.model_copy(update={"ray": address})
    if not placement.ray:
        raise InvalidInput(
            "say where to place the run: --ray ADDRESS ('local' starts a cluster here) or "
            "[placement] ray",
            field=("placement", "ray"),
        )
    trainer = config.trainer.model_copy(
        update={"run_dir": str(Path(config.trainer.run_dir).resolve())}
    )
    weights = config.weights
    if weights.sync == "inprocess":
        weights = weights.model_copy(update={"sync": "disk"})
    if weights.dir:
        weights = weights.model_copy(update={"dir": str(Path(weights.dir).resolve())})
    placed = config.model_copy(
        update={"placement": placement, "trainer": trainer, "weights": weights}
    )
    return RunConfig.model_validate(placed.model_dump(mode="json"))  # the validators again


def train_on_ray(
    config: RunConfig, address: str | None = None, *, database_url: str | None = None
) -> dict[str, Any]:
    """The whole run, placed; returns the summary (also in the run directory)."""
    from agentflow.db import migrate
    from agentflow.placement.cluster import connect, disconnect
    from trainer.embedded import run_directory, with_warm_start

    started = time.perf_counter()
    config = placed_config(config, address)
    # Devices are checked where they are used: a trainer rank or an engine actor may sit
    # on a GPU node while this process runs on one without.
    directory = run_directory(config)
    directory.mkdir(parents=True, exist_ok=True)
    config = with_warm_start(config, directory)
    # The trainer and the gateway's engines start from the warm start's output.
    config = config.model_copy(
        update={"warm_start": config.warm_start.model_copy(update={"enabled": False})}
    )
    url = database_url or f"sqlite+aiosqlite:///{(directory / 'agentflow.db').resolve()}"
    migrate.upgrade(url)
    placement = config.placement
    connect(
        placement.ray,
        num_cpus=placement.engines * placement.engine_cpus
        + config.trainer.ranks * placement.trainer_cpus
        + placement.env_servers * len(config.envs) * placement.env_cpus,
        object_store_mb=placement.object_store_mb,
    )
    try:
        summary = asyncio.run(_serve_and_train(config, url))
    finally:
        if placement.ray == "local":
            disconnect()  # the cluster this command started ends with it
    summary["total_seconds"] = round(time.perf_counter() - started, 1)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def _serve_and_train(config: RunConfig, url: str) -> dict[str, Any]:
    from agentflow.api.app import create_app
    from agentflow.api.loop_server import LoopServer
    from agentflow.config import Settings
    from agentflow.placement.cluster import LOOPBACK, node_address

    host = LOOPBACK if config.placement.ray == "local" else node_address()
    port = free_port(host)
    settings = Settings(database_url=url, public_url=f"http://{host}:{port}")
    app = create_app(settings)
    async with LoopServer(app, host, port):
        gateway = f"http://{host}:{port}"
        print(f"gateway: {gateway} (the run's controller)", flush=True)
        result = await _train_ranks(config, gateway, host)
        run_id = result.get("run_id")
        manager = app.state.run_manager
        placement: dict[str, Any] = {}
        if run_id is not None:
            import uuid

            try:
                executor = await manager.live(uuid.UUID(run_id))
            except AgentFlowError:
                executor = None
            if executor is not None:
                info = await executor.runtime.engine.info()
                placement = {
                    key: info.extra.get(key)
                    for key in ("engines", "live_engines", "engines_lost", "engines_replaced")
                }
                placement["requests_lost"] = info.extra.get("requests_lost")
                result.update(
                    episodes=executor.counters.started,
                    episodes_by_status=executor.counters.by_status,
                )
                await executor.stop("training finished")
        result["placement"] = {"ray": config.placement.ray, **placement}
        return result


async def _train_ranks(config: RunConfig, gateway: str, host: str) -> dict[str, Any]:
    """Train with `trainer.ranks` actors; rank 0's summary. When a rank's actor dies, every
    rank is started again (up to `placement.max_trainer_restarts` times): the new ranks
    take up the same run from the newest checkpoint, and its unacknowledged leases go
    back to the stream, so no trajectory is lost or trained twice past a checkpoint."""
    from agentflow.placement.cluster import import_ray

    ray = import_ray()
    restarts = 0
    while True:
        try:
            result = await _train_once(config, gateway, host)
        except ray.exceptions.RayActorError as exc:
            if restarts >= config.placement.max_trainer_restarts:
                raise AgentFlowError(
                    f"a trainer rank died {restarts + 1} times; last: {_first_line(exc)}"
                ) from None
            restarts += 1
            print(
                f"trainer: a rank's actor died ({_first_line(exc)}); starting the ranks "
                f"again from the newest checkpoint ({restarts} of "
                f"{config.placement.max_trainer_restarts})",
                flush=True,
            )
            continue
        result["trainer_restarts"] = restarts
        return result


# How long the other ranks get to answer once one has failed.
_RANK_ANSWERS_S = 30.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def _train_once(config: RunConfig, gateway: str, host: str) -> dict[str, Any]:
    """One set of trainer-rank actors in one placement group, until rank 0 is done."""
    from agentflow.placement.cluster import import_ray

    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placement, world = config.placement, config.trainer.ranks
    bundle: dict[str, float] = {"CPU": placement.trainer_cpus}
    if placement.trainer_gpus:
        bundle["GPU"] = placement.trainer_gpus
    group = ray.util.placement_group(
        [dict(bundle) for _ in range(world)], strategy=placement.strategy
    )
    await asyncio.wait_for(group.ready(), _TRAINER_READY_S)
    actors = []
    try:
        from trainer import ranks

        master = (host, free_port(host)) if ranks.needs_ranks(config) else None
        for rank in range(world):
            options = {
                "num_cpus": placement.trainer_cpus,
                "num_gpus": placement.trainer_gpus,
                "max_restarts": 0,  # restarted here, all ranks together
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            }
            actors.append(ray.remote(TrainerRank).options(**options).remote(rank, world, master))
        document = config.model_dump(mode="json")
        running = [asyncio.ensure_future(a.train.remote(document, gateway)) for a in actors]
        _, pending = await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            # A killed rank's peers fail too (their collective loses the connection), and
            # their error may come first: wait a moment for every rank's answer, so a
            # death is told from a failure and the ranks are started again.
            await asyncio.wait(pending, timeout=_RANK_ANSWERS_S)
        answered = [f for f in running if f.done()]
        for late in running:
            if not late.done():
                late.cancel()  # its actor is killed below
        errors = [e for f in answered if (e := f.exception()) is not None]
        died = [e for e in errors if isinstance(e, ray.exceptions.RayActorError)]
        if errors:  # a dead actor first: it restarts the ranks
            raise (died or errors)[0]
        return dict(running[0].result())
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, AgentFlowError | OSError):
            raise cause from None
        raise
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(group)
