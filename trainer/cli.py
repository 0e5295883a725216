"""The `agentflow` command: the composition root.

It stands above everything it puts together: the gateway's commands (`serve`, `db`,
`envs`, `runs`, `stack`, `desktop`: agentflow/cli.py) and the trainer's, defined here
(`train`, `sft`, `eval`, `trainer`). Thin: parse the run config first, then import the
module that does the work; nothing here imports torch, so `agentflow serve` starts
without it. A new command goes here when it needs the trainer, else beside its peers in
agentflow/cli.py.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentflow.cli import ConfigArg, KeyOpt, fail, print_json, read_run_config
from agentflow.cli import app as gateway_app
from agentflow.errors import AgentFlowError, InvalidInput
from trainer.ranks import ARGV_ENV

if TYPE_CHECKING:
    from agentflow.run_config import RunConfig

# What torchrun runs in each rank of `agentflow trainer` (trainer/ranks.py).
COMMAND_MODULE = "trainer.cli"

app = typer.Typer(help="AgentFlow: train LLM agents with asynchronous RL.", no_args_is_help=True)
app.add_typer(gateway_app)  # no name: its commands and groups join these at the top


@app.command()
def train(
    config: ConfigArg,
    seed: Annotated[
        int | None, typer.Option(min=0, help="override the config's seed (run NAME-seedN)")
    ] = None,
    ui_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="serve the dashboard on 127.0.0.1 at this port"),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="place engines, trainer ranks and env servers on this Ray cluster: 'local' "
            "(start one here), 'auto', or an address (docs/ray.md)",
            show_default=False,
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            help="with Ray: the run's database (default: SQLite in the run directory)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train in one process (SQLite, local engine, envs, trainer); rerun to resume.
    With --ray (or [placement] ray), the engines, the trainer's ranks and the env servers
    are Ray actors and this process is the run's gateway."""
    run_config = read_run_config(config)  # parse before importing torch: bad input fails fast
    if seed is not None:
        name = f"{run_config.name}-seed{seed}"
        run_config = run_config.model_copy(update={"seed": seed, "name": name})
    from agentflow.config import Settings

    Settings().apply_gc_threshold()  # this process is the run's gateway
    placed = ray is not None or bool(run_config.placement.ray)
    if database_url is not None and not placed:
        raise fail(InvalidInput("--database-url is for a run placed with --ray", field="ray"))
    if placed and ui_port is not None:
        raise fail(
            InvalidInput("with --ray the gateway serves the dashboard at /ui", field="ui_port")
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run prints its own progress

    try:
        if placed:
            from trainer.ray_run import train_on_ray

            summary = train_on_ray(run_config, ray, database_url=database_url)
        else:
            from trainer.embedded import train_embedded

            summary = train_embedded(run_config, ui_port=ui_port)
    except (AgentFlowError, OSError) as exc:
        raise fail(exc) from None
    print_json(summary)


@app.command()
def sft(
    config: ConfigArg,
    out: Annotated[Path | None, typer.Option(help="where to save the model")] = None,
    from_init: Annotated[
        bool,
        typer.Option(
            "--from-init",
            help="start from model.init even when model.path is set (the warm start "
            "writes the checkpoint model.path will name, as for a vLLM server)",
        ),
    ] = False,
) -> None:
    """Warm start only: supervised training on the envs' scripted oracles."""
    run_config = read_run_config(config)
    if from_init:
        model = run_config.model.model_copy(update={"path": ""})
        run_config = run_config.model_copy(update={"model": model})
    from agentflow.run_config import check_warm_start_env

    try:  # also when `warm_start.enabled` is false, which the config's parse checks
        for entry in run_config.envs:
            check_warm_start_env(entry.id, run_config.warm_start.p_oracle)
    except ValueError as exc:
        raise fail(ValueError(f"{config}: warm_start: {exc}")) from None
    from trainer.embedded import run_directory, warm_start

    target = out or run_directory(run_config) / "sft"
    try:
        metrics = warm_start(run_config, target)
    except AgentFlowError as exc:
        raise fail(exc) from None
    print_json({"model": str(target), **metrics})


@app.command("eval")
def eval_command(
    config: ConfigArg,
    model: Annotated[Path, typer.Option(help="an HF-format model directory to evaluate")],
    episodes: Annotated[int, typer.Option(min=1, help="sampled episodes per env")] = 400,
    seed: Annotated[int, typer.Option(min=0, help="seeds the env tasks and sampling")] = 0,
) -> None:
    """Play a model on each env of a run config's mix, as the run's agent would; prints
    mean reward and success rate per env."""
    run_config = read_run_config(config)
    if not (model / "config.json").is_file():
        raise fail(InvalidInput(f"no HF model at {model} (config.json missing)", field="model"))
    from dataclasses import asdict

    from transformers.utils import logging as hf_logging

    from trainer.evaluation import evaluate_run_model

    hf_logging.disable_progress_bar()
    try:
        results = evaluate_run_model(run_config, model, episodes=episodes, seed=seed)
    except AgentFlowError as exc:
        raise fail(exc) from None
    print_json({"model": str(model), "envs": {env: asdict(m) for env, m in results.items()}})


def _positive_or_none(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, not {value}")
    return value


@app.command("trainer")
def trainer_command(
    config: ConfigArg,
    gateway: Annotated[str, typer.Option(help="the gateway's base URL")],
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run",
            help="the run to train (its id); without it, the newest pending, running or "
            "paused run named like the config, else a new run created from the config",
            show_default=False,
        ),
    ] = None,
    api_key: KeyOpt = None,
    retry_window_s: Annotated[
        float | None,
        typer.Option(
            envvar="AGENTFLOW_TRAINER_RETRY_WINDOW_S",
            callback=_positive_or_none,
            help="seconds each call to the gateway is retried while it is away or hangs "
            "(connection errors, timed-out attempts, 502/503/504); then the trainer exits 1. "
            "Default: the config's trainer.gateway.retry_window_s (300)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """The split form: train a run that a gateway executes (disk or nccl weight sync).

    With `trainer.ranks > 1`, or the Megatron backend, this command starts torchrun
    with `trainer.ranks` copies of itself (trainer/ranks.py), each of which runs `main`."""
    run_config = read_run_config(config)
    if retry_window_s is not None:
        run_config = _with_retry_window(run_config, retry_window_s)
    import httpx

    from trainer import ranks
    from trainer.remote import check_split_form, train_remote

    if ranks.needs_ranks(run_config) and not ranks.in_ranks():
        try:  # refused here, once, rather than by every rank
            check_split_form(run_config)
        except AgentFlowError as exc:
            raise fail(exc) from None
        raise typer.Exit(ranks.launch(run_config.trainer.ranks, COMMAND_MODULE, sys.argv[1:]))

    try:
        run = uuid.UUID(run_id) if run_id is not None else None
        summary = train_remote(run_config, gateway, run, api_key=api_key)
    except (AgentFlowError, ValueError, httpx.TransportError) as exc:
        raise fail(exc) from None
    if "rank" not in summary:  # rank 0's, or the only process's
        print_json(summary)


def _with_retry_window(config: RunConfig, window_s: float) -> RunConfig:
    """`config` with `--retry-window-s` as its trainer.gateway.retry_window_s, checked as
    the config's own value is (the attempts' deadlines must fit in it), or exit 1."""
    from pydantic import ValidationError

    from agentflow.run_config import GatewayCallsConfig

    calls = config.trainer.gateway.model_dump() | {"retry_window_s": window_s}
    try:
        gateway = GatewayCallsConfig.model_validate(calls)
    except ValidationError as exc:
        said = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise fail(
            InvalidInput(f"--retry-window-s {window_s:g}: {said}", field=("trainer", "gateway"))
        ) from None
    trainer = config.trainer.model_copy(update={"gateway": gateway})
    return config.model_copy(update={"trainer": trainer})


def main() -> None:
    """The console script; in a rank that `agentflow trainer` started under torchrun, the
    command it was given (the arguments travel in the environment: torchrun's own parser
    would read `--run` as an abbreviation of one of its options)."""
    rank_argv = os.environ.pop(ARGV_ENV, None)  # this rank's, not its children's
    args = json.loads(rank_argv) if rank_argv is not None else None
    app(args=args, prog_name="agentflow")


if __name__ == "__main__":
    main()
