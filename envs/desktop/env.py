"""`DesktopEnv`: one desktop task per episode, OSWorld actions played through noVNC.

reset: a desktop from the provider (a fresh local one, or the remote VM), the task's
setup (a terminal opened, earlier state cleared), the noVNC page opened and connected,
the first observation. step: the action validated (envs/desktop/actions.py), played on
the canvas, the screen left to settle, the next observation. DONE or FAIL ends the
episode and the task decides the reward: 1.0 pass, 0.0 fail (infeasible tasks pass only
on FAIL, feasible ones only on DONE with their checker passing).

Observation: a user message (`Instruction: ...`, the screen size, the last action's
error), the same as `text`, `url` (the noVNC page), `image` (the remote screen as a
PNG). A bad computer action (unknown field, a point off the screen, an unknown key, a
text reply that is not a JSON action) is an error in the next observation, and the
episode goes on; an action of another kind (browser, tool calls) raises
:class:`InvalidAction`, and a step past its `timeout_s` raises :class:`StepTimeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING, Any

from envs.base import (
    Action,
    ComputerAction,
    EnvClosed,
    EnvError,
    EpisodeFinished,
    InvalidAction,
    Message,
    Observation,
    StepResult,
    StepTimeout,
    TextAction,
)
from envs.desktop.actions import ActionError, DesktopCommand, action_from_text, validate
from envs.desktop.novnc import ChromiumHost, NoVNCView, shared_host
from envs.desktop.provider import Desktop, DesktopProvider
from envs.desktop.tasks import DesktopTask, get_task

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Page

MAX_DESKTOPS_ENV_VAR = "AGENTFLOW_MAX_DESKTOPS"


class DesktopEnv:
    def __init__(
        self,
        task: DesktopTask,
        *,
        provider: DesktopProvider | None = None,
        owns_provider: bool = False,
        host: ChromiumHost | None = None,
        screen: tuple[int, int] = (1280, 800),
        settle_ms: int = 200,
        wait_s: float = 1.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.task = task
        self._provider = provider
        self._owns_provider = owns_provider
        self._host = host
        self.screen = screen
        self.settle_ms = settle_ms
        self.wait_s = wait_s
        self.connect_timeout_s = connect_timeout_s
        self._desktop: Desktop | None = None
        self._view: NoVNCView | None = None
        self._instruction = ""
        self._fields: dict[str, str] = {}
        self._steps = 0
        self._done = False
        self._closed = False
        self._error: str | None = None

    @property
    def desktop(self) -> Desktop | None:
        """The episode's desktop (for tests and tools that inspect it)."""
        return self._desktop

    # -- Env protocol -------------------------------------------------------------------

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        if self._closed:
            raise EnvClosed("reset after close()")
        await self._end_episode()
        provider = self._provider or shared_local_provider()
        host = self._host or shared_host()
        # The browser tab gets ready while the desktop starts: both take a second or so.
        tab = asyncio.ensure_future(host.new_tab(self.screen))
        try:
            self._desktop = await provider.start(self.screen)
            self._instruction, self._fields = await self.task.setup(self._desktop, seed or 0)
            context, page = await tab
            self._view = await NoVNCView.connect(
                context, page, self._desktop.novnc_url, self._desktop.screen,
                timeout_s=self.connect_timeout_s,
            )  # fmt: skip
            await self._view.settle(self.settle_ms)
        except BaseException:
            if self._view is None:
                await _discard(tab)
            await self._end_episode()
            raise
        self._steps, self._done, self._error = 0, False, None
        return await self._result()

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        if self._closed:
            raise EnvClosed("step after close()")
        if self._view is None or self._desktop is None:
            raise EnvError("step before reset()")
        if self._done:
            raise EpisodeFinished("the episode is over; reset() starts another")
        if not isinstance(action, ComputerAction | TextAction):
            raise InvalidAction(f"a desktop env takes computer or text actions, not {action.type}")
        self._steps += 1
        command, self._error = None, None
        try:
            computer = action_from_text(action.text) if isinstance(action, TextAction) else action
            command = validate(computer, self._view.screen)
        except ActionError as exc:
            self._error = str(exc)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._apply(command)
        except TimeoutError:
            raise StepTimeout(f"the desktop step took longer than {timeout_s} s") from None

    async def state(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "instruction": self._instruction,
            "steps": self._steps,
            "done": self._done,
            "desktop": None if self._desktop is None else self._desktop.id,
            "url": None if self._view is None else self._view.url,
            "last_action_error": self._error,
        }

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._end_episode()
        finally:
            if self._owns_provider and self._provider is not None:
                await self._provider.aclose()

    # -- steps --------------------------------------------------------------------------

    async def _apply(self, command: DesktopCommand | None) -> StepResult:
        assert self._view is not None
        if command is None:
            return await self._result()
        try:
            await self._view.play(command, self.wait_s)
        except Exception as exc:
            from playwright.async_api import Error as PlaywrightError

            if not isinstance(exc, PlaywrightError):
                raise
            raise EnvError(f"the noVNC page failed: {exc.message.splitlines()[0]}") from exc
        if not command.ends_episode:
            await self._view.settle(self.settle_ms)
            return await self._result()
        passed, checks = await self._judge(command.action_type)
        self._done = True
        return await self._result(1.0 if passed else 0.0, {"checks": checks, "passed": passed})

    async def _judge(self, last_action: str) -> tuple[bool, list[dict[str, Any]]]:
        """OSWorld's rule: infeasible tasks pass on FAIL; feasible ones on DONE + checker."""
        if not self.task.feasible:
            return last_action == "FAIL", []
        if last_action == "FAIL" or self._desktop is None or self._desktop.shell is None:
            return False, []
        return await self.task.checker(self._fields).run(self._desktop.shell)

    async def _result(self, reward: float = 0.0, extra: dict[str, Any] | None = None) -> StepResult:
        assert self._view is not None and self._desktop is not None
        width, height = self._view.screen
        content = f"Instruction: {self._instruction}\nScreen: {width}x{height}."
        if self._error:
            content += f"\nError: {self._error}"
        image = await self._view.screenshot()
        info: dict[str, Any] = {
            "task": self.task.name,
            "instruction": self._instruction,
            "step": self._steps,
            "screen": [width, height],
            "pointer": list(self._view.pointer),
            "last_action_error": self._error,
            "desktop": self._desktop.id,
            "display": self._desktop.display,
            **(extra or {}),
        }
        return StepResult(
            observation=Observation(
                messages=[Message(role="user", content=content)],
                text=content,
                url=self._view.url,
                image=image,
            ),
            reward=reward,
            terminated=self._done,
            info=info,
        )

    async def _end_episode(self) -> None:
        view, desktop, self._view, self._desktop = self._view, self._desktop, None, None
        try:
            if view is not None:
                await view.close()
        finally:
            if desktop is not None:
                await (self._provider or shared_local_provider()).stop(desktop)


async def _discard(tab: asyncio.Future[tuple[BrowserContext, Page]]) -> None:
    """Close the tab a failed reset prepared (or stop it being prepared)."""
    tab.cancel()
    try:
        context, _ = await tab
    except BaseException:  # cancelled, or it failed on its own: nothing is open
        return
    with contextlib.suppress(Exception):
        await context.close()


_shared_provider: Any = None


def shared_local_provider() -> DesktopProvider:
    """The local provider of this event loop (made on first use; at most
    `AGENTFLOW_MAX_DESKTOPS` desktops, 4 by default; sandboxed unless
    `AGENTFLOW_DESKTOP_UNSAFE_HOST_USER=1`); closed by `close_shared()`."""
    global _shared_provider
    from envs.desktop.local import UNSAFE_HOST_USER_ENV, LocalDesktopProvider

    loop = asyncio.get_running_loop()
    current = _shared_provider
    if current is None or current[0] is not loop:
        provider = LocalDesktopProvider(
            max_desktops=int(os.environ.get(MAX_DESKTOPS_ENV_VAR, 4)),
            unsafe_host_user=os.environ.get(UNSAFE_HOST_USER_ENV, "") == "1",
        )
        _shared_provider = (loop, provider)
        from envs import registry

        registry.on_close_shared(close_shared_local_provider)
        return provider
    return current[1]


async def close_shared_local_provider() -> None:
    global _shared_provider
    current, _shared_provider = _shared_provider, None
    if current is not None and current[0] is asyncio.get_running_loop():
        await current[1].aclose()


def make_env(
    task: str,
    *,
    novnc_url: str | None = None,
    state_url: str | None = None,
    state_api_key: str | None = None,
    screen: tuple[int, int] = (1280, 800),
    settle_ms: int = 200,
    wait_s: float = 1.0,
) -> DesktopEnv:
    """The env of desktop task `task` (a name from envs/desktop/tasks.py): on a local
    desktop, or on the remote one at `novnc_url` (with its state server at `state_url`,
    its key `state_api_key` or else `AGENTFLOW_DESKTOP_API_KEY`)."""
    provider: DesktopProvider | None = None
    if novnc_url is not None:
        from envs.desktop.remote import RemoteDesktopProvider

        provider = RemoteDesktopProvider(
            novnc_url, state_url=state_url, state_api_key=state_api_key
        )
    return DesktopEnv(
        get_task(task),
        provider=provider,
        owns_provider=provider is not None,
        screen=tuple(screen),  # type: ignore[arg-type]
        settle_ms=settle_ms,
        wait_s=wait_s,
    )
