"""`agentflow stack ...`: thin commands over :mod:`agentflow.stack`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentflow.stack import (
    BASE_IMAGE,
    DEFAULT_TAG,
    PROFILES,
    Stack,
    StackError,
    start_engine,
)

stack_app = typer.Typer(
    help="The docker-compose stack: build its images offline, bring a profile up, tear it down.",
    no_args_is_help=True,
)

ProjectDirOpt = Annotated[
    Path, typer.Option(help="the checkout holding docker-compose.yml", file_okay=False)
]
EnvFileOpt = Annotated[
    Path | None,
    typer.Option(help="compose env file (default: PROJECT_DIR/.env)", dir_okay=False),
]
NameOpt = Annotated[str, typer.Option("--name", "-p", help="compose project name")]
ProfileOpt = Annotated[str, typer.Option(help=f"one of {', '.join(PROFILES)}")]
TagOpt = Annotated[str, typer.Option(help="image tag")]


def _stack(
    project_dir: Path,
    env_file: Path | None,
    name: str,
    profile: str,
    tag: str,
    base_image: str = BASE_IMAGE,
) -> Stack:
    if env_file is None and (project_dir / ".env").is_file():
        env_file = project_dir / ".env"
    return Stack(
        project_dir.resolve(),
        name=name,
        env_file=env_file,
        profiles=(profile,),
        tag=tag,
        base_image=base_image,
    )


def _engine() -> None:
    started = start_engine(Path("/var/log/agentflow-dockerd.log"))
    if started is not None:
        typer.echo(f"started dockerd (pid {started.process.pid}; log {started.log_path})")


def _fail(exc: StackError) -> typer.Exit:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=1)


@stack_app.command("engine")
def engine() -> None:
    """Start a Docker engine (host networking only) unless one answers; it keeps running."""
    try:
        _engine()
    except StackError as exc:
        raise _fail(exc) from None


@stack_app.command("build")
def build(
    project_dir: ProjectDirOpt = Path("."),
    env_file: EnvFileOpt = None,
    tag: TagOpt = DEFAULT_TAG,
    base_image: Annotated[str, typer.Option(help="Debian bookworm base")] = BASE_IMAGE,
    profile: ProfileOpt = "cpu",
) -> None:
    """Build the images offline: debootstrap base, host-made wheelhouse, no package index
    (`--profile vllm` adds the vLLM image)."""
    try:
        _engine()
        _stack(project_dir, env_file, "agentflow", profile, tag, base_image).build()
    except StackError as exc:
        raise _fail(exc) from None
    typer.echo("images built")


@stack_app.command("up")
def up(
    services: Annotated[list[str] | None, typer.Argument(help="only these services")] = None,
    project_dir: ProjectDirOpt = Path("."),
    env_file: EnvFileOpt = None,
    name: NameOpt = "agentflow",
    profile: ProfileOpt = "cpu",
    tag: TagOpt = DEFAULT_TAG,
    timeout: Annotated[float, typer.Option(help="seconds to wait for health")] = 600,
) -> None:
    """Start a profile (images must be built) and wait until its services are healthy."""
    try:
        _engine()
        stack = _stack(project_dir, env_file, name, profile, tag)
        stack.up(*(services or ()), timeout=timeout)
    except StackError as exc:
        raise _fail(exc) from None
    typer.echo(f"{name}: {profile} profile up")


@stack_app.command("down")
def down(
    project_dir: ProjectDirOpt = Path("."),
    env_file: EnvFileOpt = None,
    name: NameOpt = "agentflow",
    keep_volumes: Annotated[bool, typer.Option(help="keep the database and weights")] = False,
) -> None:
    """Stop and remove every container of the project (both profiles), volumes too."""
    try:
        _stack(project_dir, env_file, name, "cpu", DEFAULT_TAG).down(volumes=not keep_volumes)
    except StackError as exc:
        raise _fail(exc) from None
    typer.echo(f"{name}: down")
