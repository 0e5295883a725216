"""Remote desktops: VMs (or containers) that already serve a noVNC page.

The provider starts nothing: `start()` hands out the page it was given, and the env
connects to it like to a local one (the screen size is read from the page). What a
remote desktop supports depends on what the VM exposes besides its VNC view:

- the view only: tasks judged by the episode itself (the infeasible ones, scored by the
  last action) and whatever a policy sees in its screenshots;
- a state server at `state_url` speaking OSWorld's VM server protocol (`POST /execute`
  `{"command", "shell"}` -> `{"output", "error", "returncode"}`, `POST /file` with form
  field `file_path`, `POST /setup/upload` with `file_path` and `file_data`, `POST
  /setup/launch` `{"command", "shell"}`): everything a local desktop supports, because
  task setup and checkers go through it (:class:`StateServerShell`). Paths are sent as
  `~/<path>` for the VM to expand in its user's home. Requests carry
  `Authorization: Bearer <state_api_key>` when a key is given, else the gateway's
  `AGENTFLOW_DESKTOP_API_KEY` when set (the key of the stack's `desktop` service,
  envs/desktop/state_server.py), so a registered spec need not store it.

A remote desktop is shared across episodes (nothing restarts it): tasks clear what
they check before they start (`DesktopTask.reset_command`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from envs.base import EnvError
from envs.desktop.provider import CommandResult, Desktop

API_KEY_ENV = "AGENTFLOW_DESKTOP_API_KEY"  # the state server's (envs/desktop/state_server.py)

if TYPE_CHECKING:
    import httpx


class StateServerShell:
    """`DesktopShell` over a VM's OSWorld-style state server."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def run(self, command: str, timeout_s: float = 10.0) -> CommandResult:
        import httpx

        try:
            response = await self._client.post(
                "/execute", json={"command": command, "shell": True}, timeout=timeout_s + 5
            )
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise EnvError(f"the desktop's state server failed /execute: {exc}") from exc
        return CommandResult(
            int(body.get("returncode", 1)), str(body.get("output", "")), str(body.get("error", ""))
        )

    async def read_file(self, path: str) -> bytes | None:
        response = await self._client.post("/file", data={"file_path": _home_path(path)})
        if response.status_code == 404:
            return None
        _check(response, "/file")
        return response.content

    async def write_file(self, path: str, data: bytes) -> None:
        response = await self._client.post(
            "/setup/upload",
            data={"file_path": _home_path(path)},
            files={"file_data": ("file", data)},
        )
        _check(response, "/setup/upload")

    async def launch(self, argv: Sequence[str]) -> None:
        response = await self._client.post(
            "/setup/launch", json={"command": list(argv), "shell": False}
        )
        _check(response, "/setup/launch")


class RemoteDesktopProvider:
    """`DesktopProvider` for one remote desktop at `novnc_url`."""

    def __init__(
        self, novnc_url: str, *, state_url: str | None = None, state_api_key: str | None = None
    ) -> None:
        self.novnc_url = novnc_url
        self.state_url = state_url
        self._api_key = state_api_key or os.environ.get(API_KEY_ENV) or None
        self._client: httpx.AsyncClient | None = None

    async def start(self, screen: tuple[int, int] = (1280, 800)) -> Desktop:
        shell = None
        if self.state_url is not None:
            if self._client is None:
                import httpx

                headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
                self._client = httpx.AsyncClient(
                    base_url=self.state_url, headers=headers, timeout=30.0
                )
            shell = StateServerShell(self._client)
        return Desktop(
            id=f"remote-{uuid.uuid4().hex[:8]}",
            novnc_url=self.novnc_url,
            screen=None,  # the VM's own: read from its page
            shell=shell,
            info={"state_url": self.state_url or ""},
        )

    async def stop(self, desktop: Desktop) -> None:
        """Nothing to stop: the VM outlives the episode."""

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _home_path(path: str) -> str:
    return path if path.startswith(("~/", "/")) else f"~/{path}"


def _check(response: httpx.Response, route: str) -> None:
    if response.status_code >= 400:
        raise EnvError(f"the desktop's state server answered {response.status_code} on {route}")
