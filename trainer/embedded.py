"""`agentflow train CONFIG.toml`: the embedded default, everything in one process.

SQLite in the run directory, the run's `LocalEngine`, envs and agents driven by the same
`RunManager` the gateway uses, and the trainer reading the same durable trajectory
stream. Running the same command again after a crash resumes: the run (found by name in
the run directory's database) restarts from its stored config, and the trainer from its
newest checkpoint (see `trainer.loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.loop_server import LoopServer
from agentflow.config import Settings
from agentflow.db import migrate
from agentflow.db.blobs import blob_store_for
from agentflow.db.runs import LIVE_RUN_STATUSES
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import InvalidInput
from agentflow.inference.base import WeightUpdate
from agentflow.rollout.manager import RunManager
from agentflow.run_config import LocalEngineConfig, RunConfig, check_device
from agentflow.ui.app import create_dashboard_app
from envs import registry
from trainer.backends.base import Policy
from trainer.loggers import build_loggers
from trainer.loop import resume, summarize_batch, train
from trainer.report import RunReport
from trainer.setup import build_policy, loop_settings
from trainer.teachers import build_teachers, check_teachers
from trainer.weights import WeightPublisher

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from trainer.sft import SftConfig

log = logging.getLogger(__name__)


def run_directory(config: RunConfig) -> Path:
    return Path(config.trainer.run_dir) / config.name


def prepare(config: RunConfig) -> tuple[RunConfig, Path]:
    """Check what this process can train, and run the warm start if the run needs it.
    Returns the config with `model.path` pointing at the weights RL starts from.

    Options not built yet (megatron, rtpo, nccl, kl_coef) never get here: the config's
    parse refuses them. Checked here is what depends on this process form and this
    machine (teacher checkpoints among it), before anything is written or trained."""
    if config.engine.type == "sglang":
        raise InvalidInput(
            "the embedded trainer updates a local engine in process, or vLLM servers from "
            "disk; use `agentflow trainer --gateway URL` with disk sync for SGLang",
            field=("engine", "type"),
        )
    if config.trainer.backend == "megatron":
        from trainer.backends.megatron.policy import require_cuda

        require_cuda()  # the first thing to say on a machine without
        raise InvalidInput(
            "the Megatron backend trains a gateway's run under torchrun: "
            "`agentflow trainer CONFIG --gateway URL`",
            field=("trainer", "backend"),
        )
    if config.trainer.ranks > 1:
        raise InvalidInput(
            "the embedded trainer is one process; several trainer ranks train a gateway's "
            "run: `agentflow trainer CONFIG --gateway URL`",
            field=("trainer", "ranks"),
        )
    if isinstance(config.engine, LocalEngineConfig):
        check_device(config.engine.device, ("engine", "device"))
    check_device(config.trainer.device, ("trainer", "device"))
    check_teachers(config)
    directory = run_directory(config)
    directory.mkdir(parents=True, exist_ok=True)
    config = with_warm_start(config, directory)
    if config.trainer.threads:
        import torch

        # After the warm start, which has the machine to itself: during RL the engine and
        # the trainer compute at the same time, each in its own thread.
        torch.set_num_threads(config.trainer.threads)
    return config, directory


def with_warm_start(config: RunConfig, directory: Path) -> RunConfig:
    """Run the warm start unless it already ran; the config then points at its model."""
    warm = config.warm_start
    if not warm.enabled:
        return config
    sft_dir = directory / "sft"
    if not (sft_dir / "config.json").is_file():
        print(f"warm start: supervised training on {warm.n_episodes} oracle episodes", flush=True)
        metrics = warm_start(config, sft_dir, progress=lambda line: print(line, flush=True))
        print(f"warm start done: {metrics.get('eval', {})}", flush=True)
    model = config.model.model_copy(update={"path": str(sft_dir.resolve())})
    return config.model_copy(update={"model": model})


def warm_start(
    config: RunConfig, out_dir: Path, *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """SFT on the envs' noisy oracles, as `[warm_start]` says; the model goes to
    `out_dir`. Returns the warm start's metrics (with its evaluation)."""
    from trainer.sft import run_sft

    return run_sft(
        warm_start_config(config),
        config.model.path or config.model.init,
        out_dir,
        progress=progress,
    )


def warm_start_config(config: RunConfig) -> SftConfig:
    """The warm start of a run: its `[warm_start]`, played as its agent plays (the same
    system prompt and budgets), so the warm start's data is what RL will see."""
    from trainer.sft import SftConfig

    # Every env of the mix (or the warm start's own list), in turn: it sees what RL will.
    env_ids = config.warm_start.envs or [e.id for e in config.envs]
    return SftConfig(
        env_id=env_ids if len(env_ids) > 1 else env_ids[0],
        env_kwargs={e.id: dict(e.kwargs) for e in config.envs if e.kwargs and e.id in env_ids},
        max_turns=config.agent.max_turns,
        max_tokens=config.agent.max_tokens,
        max_new_tokens=config.agent.max_new_tokens,
        system_prompt=config.agent.system_prompt,
        seed=config.seed,
        **config.warm_start.model_dump(exclude={"enabled", "envs"}),
    )


def train_embedded(config: RunConfig, *, ui_port: int | None = None) -> dict[str, Any]:
    """The whole run; returns the summary (also written to the run directory).
    `ui_port`: serve the dashboard on 127.0.0.1 at this port while it trains."""
    started = time.perf_counter()
    config, directory = prepare(config)
    url = f"sqlite+aiosqlite:///{(directory / 'agentflow.db').resolve()}"
    migrate.upgrade(url)
    summary = asyncio.run(_train(config, directory, url, ui_port))
    summary["total_seconds"] = round(time.perf_counter() - started, 1)  # warm start included
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def _train(
    config: RunConfig, directory: Path, url: str, ui_port: int | None
) -> dict[str, Any]:
    engine = create_engine(url)
    settings = Settings(database_url=url)
    turns = TurnTree(session_factory(engine), blob_store=blob_store_for(settings))
    runtimes = RuntimeRegistry()
    manager = RunManager(turns, runtimes, settings, trainer_in_process=True)
    try:
        async with contextlib.AsyncExitStack() as serving:
            if ui_port is not None:
                app = create_dashboard_app(settings, turns, runtimes, manager)
                dashboard = await serving.enter_async_context(LoopServer(app, "127.0.0.1", ui_port))
                print(f"dashboard: http://127.0.0.1:{dashboard.port}/ui", flush=True)
            return await _train_run(config, directory, engine, manager)
    finally:
        await engine.dispose()


async def _train_run(
    config: RunConfig,
    directory: Path,
    engine: AsyncEngine,
    manager: RunManager,
) -> dict[str, Any]:
    settings_doc = config.model_dump(mode="json")
    report = RunReport(
        directory,
        config.trainer.steps,
        loggers=build_loggers(config.logger, directory, config.name, settings_doc),
    )
    report.write_config(settings_doc)
    started = time.perf_counter()
    try:
        run_id = await _start_or_recover(manager, config)
        executor = await manager.live(run_id)
        policy = build_policy(config)
        stream = await manager.stream(run_id)
        checkpoints = directory / "checkpoints"
        state, restored = await resume(policy, stream, checkpoints)
        # The steps after the checkpoint are done again, each writing its row anew.
        report.keep_through(state.step)
        target = _RunTarget(manager, run_id)
        publisher = _publisher(config, directory, target, policy)
        if restored is not None:
            # The engine restarted from the warm-start weights: give it the checkpoint's,
            # as a version newer than any the run has recorded.
            state.version = max(state.version, executor.weight_version) + 1
            await publisher.publish(policy.state_dict(), state.version)
            print(f"resumed from {restored} at step {state.step}", flush=True)

        async def on_step(step: int, metrics: dict[str, float], batch: Any) -> None:
            row = {**summarize_batch(batch, state.version - 1), **metrics}  # as trained
            row.update(
                episodes=float(executor.counters.started),
                dropped_stale=float(stream.counters.dropped_stale),
                weight_version=float(state.version),
            )
            ids = [str(t.id) for t in batch]
            report.record(step, row, version=state.version, trajectory_ids=ids)
            await manager.record_metrics(run_id, state.version, row, step)

        def alive() -> str | None:
            if executor.state in ("running", "paused"):
                return None
            return f"run is {executor.state}: {executor.counters.last_error}"

        async def on_error(step: int, message: str) -> None:
            report.error(step, message)

        steps = loop_settings(config, checkpoints)
        teachers = build_teachers(config, policy.model)
        try:
            await train(
                policy,
                stream,
                publisher,
                steps,
                state,
                on_step=on_step,
                alive=alive,
                teachers=teachers,
                on_error=on_error,
            )
        finally:
            if teachers is not None:
                await teachers.close()
        await executor.stop("training finished")
        return report.finish(
            {
                "run": config.name,
                "run_id": str(run_id),
                "seed": config.seed,
                "run_dir": str(directory),
                "wall_seconds": round(time.perf_counter() - started, 1),
                "episodes": executor.counters.started,
                "episodes_by_status": executor.counters.by_status,
                "stream": {
                    "served_fresh": stream.counters.served_fresh,
                    "served_replay": stream.counters.served_replay,
                    "dropped_stale": stream.counters.dropped_stale,
                    "rejected": stream.counters.rejected,
                },
            }
        )
    finally:
        report.close()
        try:
            await manager.shutdown()
        finally:
            await registry.close_shared()  # the browsers envs share, and the like
        await engine.dispose()


async def _start_or_recover(manager: RunManager, config: RunConfig) -> uuid.UUID:
    """The run of this name in this database: restarted after a crash, or created."""
    existing = await manager.runs.latest(config.name)
    if existing is not None and existing.status in LIVE_RUN_STATUSES:
        await manager.recover()  # aborts its interrupted episodes, restarts it
        return existing.id
    return await manager.create(config)


class _RunTarget:
    """The run's engines, switched through the run manager (pause, update, resume)."""

    name = "run"

    def __init__(self, manager: RunManager, run_id: uuid.UUID) -> None:
        self.manager, self.run_id = manager, run_id

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self.manager.update_weights(self.run_id, update)


def _publisher(
    config: RunConfig, directory: Path, target: _RunTarget, policy: Policy
) -> WeightPublisher:
    sync = config.weights.sync
    assert sync != "nccl", "refused when the config is parsed"
    weights_dir = Path(config.weights.dir) if config.weights.dir else directory / "weights"
    return WeightPublisher(
        sync,
        [target],
        weights_dir if sync == "disk" else None,
        config=policy.model.config,
        untied_head=config.engine.type == "vllm",
    )
