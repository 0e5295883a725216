"""The `agentflow` command. Thin: parse arguments, then call the API client or a module.

Nothing here imports torch; the subcommands that need it import it when they run.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import BaseModel

from agentflow.desktop_cli import desktop_app
from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.stack_cli import stack_app

app = typer.Typer(help="AgentFlow: train LLM agents with asynchronous RL.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema migrations.", no_args_is_help=True)
envs_app = typer.Typer(help="The environment registry.", no_args_is_help=True)
runs_app = typer.Typer(help="Runs.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(envs_app, name="envs")
app.add_typer(runs_app, name="runs")
app.add_typer(stack_app, name="stack")
app.add_typer(desktop_app, name="desktop")

UrlOpt = Annotated[str, typer.Option(envvar="AGENTFLOW_URL", help="gateway base URL")]
KeyOpt = Annotated[
    str | None, typer.Option(envvar="AGENTFLOW_API_KEY", help="API key", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
DEFAULT_URL = "http://127.0.0.1:8000"


def _print(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    typer.echo(json.dumps(value, indent=2, default=str))


def _client(url: str, api_key: str | None) -> Any:
    from agentflow.client import Client

    return Client(url, api_key=api_key)


def _fail(exc: Exception) -> typer.Exit:
    message = str(exc)
    if isinstance(exc, InvalidInput) and exc.field:  # name the field, as the API's 422 does
        field = ".".join(exc.field[1:] if exc.field[0] == "body" else exc.field)
        if field not in message.partition(": ")[0]:
            message = f"{field}: {message}"
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=1)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
) -> None:
    """Run the gateway (REST API) against AGENTFLOW_DATABASE_URL."""
    import uvicorn

    from agentflow.api.app import create_app
    from agentflow.config import get_settings
    from agentflow.db.migrate import ensure_schema_current
    from agentflow.db.session import create_engine

    settings = get_settings()
    settings.apply_gc_threshold()

    async def check() -> None:
        engine = create_engine(settings.database_url)
        try:
            await ensure_schema_current(engine)
        finally:
            await engine.dispose()

    try:
        asyncio.run(check())
    except (AgentFlowError, OSError) as exc:
        raise _fail(exc) from None
    from agentflow.api.public_url import served_url

    try:
        sock = _listening_socket(host, port)
    except OSError as exc:
        raise _fail(exc) from None
    if settings.public_url is None:
        # Agents are handed the address actually served (the port may be 0: any free one).
        settings = settings.model_copy(
            update={"public_url": served_url(host, sock.getsockname()[1])}
        )
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="info")
    uvicorn.Server(config).run(sockets=[sock])


def _listening_socket(host: str, port: int) -> socket.socket:
    """Bound before the app is built, so the app knows the port it serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply migrations up to REVISION (default: head)."""
    from agentflow.config import get_settings
    from agentflow.db import migrate

    migrate.upgrade(get_settings().database_url, revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()]) -> None:
    """Revert migrations down to REVISION (`base` empties the schema)."""
    from agentflow.config import get_settings
    from agentflow.db import migrate

    migrate.downgrade(get_settings().database_url, revision)
    typer.echo(f"database at {revision}")


@envs_app.command("register")
def envs_register(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML")],
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Register the environment described in FILE."""
    body = yaml.safe_load(file.read_text())  # YAML is a superset of JSON
    try:
        with _client(url, api_key) as client:
            _print(client.create_env(body))
    except AgentFlowError as exc:
        raise _fail(exc) from None


@envs_app.command("list")
def envs_list(
    name: Annotated[str | None, typer.Option()] = None,
    kind: Annotated[str | None, typer.Option()] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List registered environments."""
    try:
        with _client(url, api_key) as client:
            page = client.list_envs(name=name, kind=kind, limit=500)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    if as_json:
        _print(page)
        return
    for env in page.items:
        typer.echo(f"{env.id}  {env.name}@{env.version}  {env.kind}  {env.description[:50]}")
    typer.echo(f"{page.total} environment(s)")


@envs_app.command("show")
def envs_show(env_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Show one environment."""
    try:
        with _client(url, api_key) as client:
            _print(client.get_env(env_id))
    except AgentFlowError as exc:
        raise _fail(exc) from None


@envs_app.command("delete")
def envs_delete(env_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Delete an environment (refused while an active run uses it)."""
    try:
        with _client(url, api_key) as client:
            client.delete_env(env_id)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    typer.echo(f"deleted {env_id}")


@envs_app.command("serve")
def envs_serve(
    target: Annotated[str, typer.Argument(help="`module:Class` or a registered env id")],
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
) -> None:
    """Serve one env over HTTP and WebSocket with stateful sessions."""
    from envs.server import serve as serve_env

    serve_env(target, host=host, port=port)


@runs_app.command("list")
def runs_list(
    status: Annotated[str | None, typer.Option()] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first."""
    try:
        with _client(url, api_key) as client:
            page = client.list_runs(status=status, limit=500)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    if as_json:
        _print(page)
        return
    for run in page.items:
        typer.echo(f"{run.id}  {run.name}  {run.status}  v{run.weight_version}")
    typer.echo(f"{page.total} run(s)")


@runs_app.command("create")
def runs_create(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="run config TOML")],
    start: Annotated[bool, typer.Option("--start/--no-start", help="play episodes now")] = True,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Create a run from a TOML config (validated here first, then by the gateway)."""
    config = _run_config(file)
    try:
        with _client(url, api_key) as client:
            _print(client.create_run(config, start=start))
    except AgentFlowError as exc:
        raise _fail(exc) from None


@runs_app.command("control")
def runs_control(
    run_id: str,
    action: Annotated[str, typer.Argument(help="pause, resume or stop")],
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Pause, resume or stop a live run."""
    actions = {"pause": "pause_run", "resume": "resume_run", "stop": "stop_run"}
    if action not in actions:
        raise _fail(ValueError(f"action must be one of {sorted(actions)}"))
    try:
        with _client(url, api_key) as client:
            _print(getattr(client, actions[action])(run_id))
    except AgentFlowError as exc:
        raise _fail(exc) from None


@runs_app.command("episodes")
def runs_episodes(
    run_id: str,
    status: Annotated[str | None, typer.Option()] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """List a run's episodes."""
    try:
        with _client(url, api_key) as client:
            page = client.list_run_episodes(run_id, status=status, limit=1000)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    for e in page.items:
        reward = "-" if e.reward is None else f"{e.reward:.3f}"
        typer.echo(f"{e.id}  {e.env_ref}  {e.status}  reward={reward}  {e.error or ''}")
    typer.echo(f"{page.total} episode(s)")


@runs_app.command("show")
def runs_show(run_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Show one run with its config."""
    try:
        with _client(url, api_key) as client:
            _print(client.get_run(run_id))
    except AgentFlowError as exc:
        raise _fail(exc) from None


def _run_config(path: Path) -> Any:
    from pydantic import ValidationError

    from agentflow.run_config import load_run_config

    try:
        return load_run_config(path)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise _fail(ValueError(f"{path}: {where}: {message}")) from None
    except (OSError, ValueError) as exc:  # unreadable file, TOML syntax
        raise _fail(exc) from None


ConfigArg = Annotated[
    Path, typer.Argument(exists=True, dir_okay=False, help="run config (TOML, or JSON as *.json)")
]


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
    run_config = _run_config(config)  # parse before importing torch: bad input fails fast
    if seed is not None:
        name = f"{run_config.name}-seed{seed}"
        run_config = run_config.model_copy(update={"seed": seed, "name": name})
    from agentflow.config import Settings

    Settings().apply_gc_threshold()  # this process is the run's gateway
    placed = ray is not None or bool(run_config.placement.ray)
    if database_url is not None and not placed:
        raise _fail(InvalidInput("--database-url is for a run placed with --ray", field="ray"))
    if placed and ui_port is not None:
        raise _fail(
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
        raise _fail(exc) from None
    _print(summary)


@app.command()
def sft(
    config: ConfigArg,
    out: Annotated[Path | None, typer.Option(help="where to save the model")] = None,
) -> None:
    """Warm start only: supervised training on the envs' scripted oracles."""
    run_config = _run_config(config)
    from agentflow.run_config import check_warm_start_env

    try:  # also when `warm_start.enabled` is false, which the config's parse checks
        for entry in run_config.envs:
            check_warm_start_env(entry.id, run_config.warm_start.p_oracle)
    except ValueError as exc:
        raise _fail(ValueError(f"{config}: warm_start: {exc}")) from None
    from trainer.embedded import run_directory, warm_start

    target = out or run_directory(run_config) / "sft"
    try:
        metrics = warm_start(run_config, target)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    _print({"model": str(target), **metrics})


@app.command("eval")
def eval_command(
    config: ConfigArg,
    model: Annotated[Path, typer.Option(help="an HF-format model directory to evaluate")],
    episodes: Annotated[int, typer.Option(min=1, help="sampled episodes per env")] = 400,
    seed: Annotated[int, typer.Option(min=0, help="seeds the env tasks and sampling")] = 0,
) -> None:
    """Play a model on each env of a run config's mix, as the run's agent would; prints
    mean reward and success rate per env."""
    run_config = _run_config(config)
    if not (model / "config.json").is_file():
        raise _fail(InvalidInput(f"no HF model at {model} (config.json missing)", field="model"))
    from dataclasses import asdict

    from transformers.utils import logging as hf_logging

    from trainer.evaluation import evaluate_run_model

    hf_logging.disable_progress_bar()
    try:
        results = evaluate_run_model(run_config, model, episodes=episodes, seed=seed)
    except AgentFlowError as exc:
        raise _fail(exc) from None
    _print({"model": str(model), "envs": {env: asdict(m) for env, m in results.items()}})


def _positive(value: float) -> float:
    if not value > 0:
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
        float,
        typer.Option(
            envvar="AGENTFLOW_TRAINER_RETRY_WINDOW_S",
            callback=_positive,
            help="seconds each call to the gateway is retried while it is away "
            "(connection errors, 502/503/504); then the trainer exits 1",
        ),
    ] = 300.0,
) -> None:
    """The split form: train a run that a gateway executes (disk or nccl weight sync).

    With `trainer.ranks > 1`, or the Megatron backend, this command starts torchrun
    with `trainer.ranks` copies of itself (trainer/ranks.py)."""
    run_config = _run_config(config)
    import httpx

    from agentflow.client import RetryPolicy
    from trainer import ranks
    from trainer.remote import check_split_form, train_remote

    if ranks.needs_ranks(run_config) and not ranks.in_ranks():
        try:  # refused here, once, rather than by every rank
            check_split_form(run_config)
        except AgentFlowError as exc:
            raise _fail(exc) from None
        raise typer.Exit(ranks.launch(run_config.trainer.ranks, sys.argv[1:]))

    retry = RetryPolicy(window_s=retry_window_s)
    try:
        run = uuid.UUID(run_id) if run_id is not None else None
        summary = train_remote(run_config, gateway, run, api_key=api_key, retry=retry)
    except (AgentFlowError, ValueError, httpx.TransportError) as exc:
        raise _fail(exc) from None
    if "rank" not in summary:  # rank 0's, or the only process's
        _print(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
