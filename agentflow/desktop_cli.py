"""`agentflow desktop ...`: thin commands over :mod:`envs.desktop.service`."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Annotated, Any

import typer

desktop_app = typer.Typer(
    help="Desktops for computer-use envs: serve one (the stack's `desktop` service).",
    no_args_is_help=True,
)


def _port(envvar: str, what: str) -> Any:
    return typer.Option(envvar=envvar, min=1, max=65535, help=f"{what} port on 127.0.0.1")


def _screen(value: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", value)
    if match is None:
        raise typer.BadParameter("expected WIDTHxHEIGHT, e.g. 1280x800")
    width, height = int(match[1]), int(match[2])
    if not (320 <= width <= 3840 and 240 <= height <= 2160):
        raise typer.BadParameter("must be between 320x240 and 3840x2160")
    return width, height


@desktop_app.command("serve")
def serve(
    display: Annotated[
        int, typer.Option(envvar="AGENTFLOW_DESKTOP_DISPLAY", min=0, help="X display number")
    ] = 99,
    vnc_port: Annotated[int, _port("AGENTFLOW_DESKTOP_VNC_PORT", "x11vnc's")] = 5999,
    novnc_port: Annotated[int, _port("AGENTFLOW_DESKTOP_NOVNC_PORT", "the noVNC page's")] = 6080,
    state_port: Annotated[int, _port("AGENTFLOW_DESKTOP_STATE_PORT", "the state server's")] = 6090,
    screen: Annotated[
        str, typer.Option(envvar="AGENTFLOW_DESKTOP_SCREEN", help="WIDTHxHEIGHT")
    ] = "1280x800",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AGENTFLOW_DESKTOP_API_KEY",
            help="bearer key of the state server",
            show_default=False,
        ),
    ] = None,
    development: Annotated[
        bool, typer.Option("--development", help="allow a state server without a key")
    ] = False,
    runtime_dir: Annotated[
        Path | None,
        typer.Option(envvar="AGENTFLOW_DESKTOP_RUNTIME_DIR", help="where the desktop lives"),
    ] = None,
    unsafe_host_user: Annotated[
        bool,
        typer.Option(
            "--unsafe-host-user",
            envvar="AGENTFLOW_DESKTOP_UNSAFE_HOST_USER",
            help="run the desktop as this user on this host instead of in the sandbox: "
            "its terminal is then a shell here (only inside a container or VM of its own)",
        ),
    ] = False,
) -> None:
    """Start one desktop (Xvfb, openbox, x11vnc, noVNC) and its state server; stop both
    on SIGTERM."""
    from envs.desktop.service import ServeOptions, novnc_url
    from envs.desktop.service import serve as serve_desktop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = ServeOptions(
        display=display,
        vnc_port=vnc_port,
        novnc_port=novnc_port,
        state_port=state_port,
        api_key=(api_key or "").strip() or None,
        development=development,
        screen=_screen(screen),
        runtime_dir=runtime_dir,
        unsafe_host_user=unsafe_host_user,
    )
    typer.echo(f"desktop: noVNC {novnc_url(options)}, state server :{state_port}", err=True)
    try:
        code = asyncio.run(serve_desktop(options))
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    except Exception as exc:  # the desktop did not start: say why, exit non-zero
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    raise typer.Exit(code=code)
