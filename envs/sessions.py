"""Stateful env sessions for the env server: capacity, idle reaping, idempotent steps.

A session owns one env. Calls on it are serialised by a lock; a session that holds
thread-bound objects (Playwright, some simulators) gets its own thread with its own
event loop, and every call on its env (construction included) runs there.

What ends a session: ``DELETE``, the idle reaper (no call for ``idle_ttl_s``), server
shutdown, and any failure that leaves the env in an unknown state -- a step past its
timeout, or an env that raised something other than an :class:`EnvError` it meant to
raise. Those close the env and drop the session, so the next call answers 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from envs.base import (
    Action,
    Env,
    EnvCapacity,
    EnvError,
    EpisodeFinished,
    InvalidAction,
    StepResult,
    StepTimeout,
    UnknownEnv,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
EnvFactory = Callable[[], Env]
# Errors an env raises on purpose about *this request*; the env itself is still sound.
_RECOVERABLE = (InvalidAction, EpisodeFinished)
# Extra time the server allows past a step's own timeout before it gives up on the env.
TIMEOUT_GRACE_S = 0.5


class Runner:
    """Runs a session's coroutines on the server's event loop."""

    async def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return await make()

    async def close(self) -> None:
        return None


class ThreadRunner(Runner):
    """Runs a session's coroutines on its own thread and event loop (thread-bound envs)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    async def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return await asyncio.wrap_future(future)

    async def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        # Joined off the server's loop: an env stuck in blocking code must not stall it.
        await asyncio.to_thread(self.thread.join, 5)
        if not self.thread.is_alive():
            self.loop.close()


class Session:
    """One env and what the server needs to serve it."""

    def __init__(self, env_name: str, runner: Runner, replay_size: int = 32) -> None:
        self.id = uuid.uuid4().hex
        self.env_name = env_name
        self.runner = runner
        self.env: Env | None = None
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.steps = 0
        self.closed = False
        self._replies: OrderedDict[str, asyncio.Task[StepResult]] = OrderedDict()
        self._replay_size = replay_size

    @property
    def live_env(self) -> Env:
        if self.env is None or self.closed:
            raise UnknownEnv(f"session {self.id} is closed")
        return self.env

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionManager:
    """All sessions of one server."""

    def __init__(
        self,
        factories: dict[str, EnvFactory],
        *,
        max_sessions: int = 1024,
        idle_ttl_s: float = 600.0,
        step_timeout_s: float = 60.0,
        thread_per_session: bool = False,
    ) -> None:
        if max_sessions < 1 or idle_ttl_s <= 0 or step_timeout_s <= 0:
            raise ValueError("max_sessions, idle_ttl_s and step_timeout_s must be positive")
        self.factories = factories
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.step_timeout_s = step_timeout_s
        self.thread_per_session = thread_per_session
        self.sessions: dict[str, Session] = {}
        self._reserved = 0
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------

    async def open(self, env_name: str) -> Session:
        factory = self.factories.get(env_name)
        if factory is None:
            raise UnknownEnv(
                f"this server serves no env {env_name!r}; it serves {sorted(self.factories)}"
            )
        if len(self.sessions) + self._reserved >= self.max_sessions:
            raise EnvCapacity(f"the server holds its maximum of {self.max_sessions} sessions")
        self._reserved += 1  # hold the slot while the env is built (an await)
        thread_bound = self.thread_per_session or getattr(factory, "thread_bound", False)
        runner: Runner = ThreadRunner(f"env-session-{env_name}") if thread_bound else Runner()
        session = Session(env_name, runner)
        try:

            async def build() -> Env:
                return factory()

            session.env = await runner.call(build)
        except BaseException:
            await runner.close()
            raise
        finally:
            self._reserved -= 1
        self.sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownEnv(f"no session {session_id!r} (never opened, closed, or reaped)")
        return session

    async def close(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise UnknownEnv(f"no session {session_id!r}")
        await self._shutdown(session)

    async def _shutdown(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        env = session.env
        if env is not None:
            try:
                await asyncio.wait_for(session.runner.call(env.close), timeout=10)
            except Exception:  # a broken env must not keep its session (or the server) alive
                log.exception("closing env of session %s failed", session.id)
        for task in session._replies.values():
            if not task.done():
                task.cancel()
        await session.runner.close()

    async def close_all(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        await asyncio.gather(*(self._shutdown(s) for s in sessions))

    # -- calls ---------------------------------------------------------------------

    async def _guarded(
        self, session: Session, make: Callable[[], Awaitable[T]], timeout: float
    ) -> T:
        """Run one call on the session's env; close the session if the env broke."""
        try:
            return await asyncio.wait_for(session.runner.call(make), timeout)  # type: ignore[arg-type]
        except _RECOVERABLE:
            raise
        except TimeoutError:
            await self._drop(session)
            raise StepTimeout(f"session {session.id}: no answer within {timeout:.3g} s") from None
        except EnvError:
            await self._drop(session)
            raise
        except Exception as exc:
            await self._drop(session)
            raise EnvError(f"env {session.env_name!r} failed: {type(exc).__name__}: {exc}") from exc

    async def _drop(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        await self._shutdown(session)

    async def reset(
        self, session: Session, seed: int | None, options: dict[str, Any] | None
    ) -> StepResult:
        async with session.lock:
            env = session.live_env
            session.touch()
            result = await self._guarded(
                session, lambda: env.reset(seed=seed, options=options), self.step_timeout_s
            )
            session.steps = 0
            session.touch()
            return result

    async def step(
        self,
        session: Session,
        action: Action,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> StepResult:
        """Step once; a repeated ``request_id`` answers the first attempt's result."""
        if request_id is not None and request_id in session._replies:
            return await asyncio.shield(session._replies[request_id])
        task = asyncio.ensure_future(self._step(session, action, timeout_s))
        if request_id is not None:
            session._replies[request_id] = task
            while len(session._replies) > session._replay_size:
                session._replies.popitem(last=False)
        return await asyncio.shield(task)

    async def _step(self, session: Session, action: Action, timeout_s: float | None) -> StepResult:
        async with session.lock:
            env = session.live_env
            session.touch()
            limit = min(timeout_s or self.step_timeout_s, self.step_timeout_s)
            result = await self._guarded(
                session, lambda: env.step(action, timeout_s=limit), limit + TIMEOUT_GRACE_S
            )
            session.steps += 1
            session.touch()
            return result

    async def state(self, session: Session) -> dict[str, Any]:
        async with session.lock:
            env = session.live_env
            session.touch()
            return await self._guarded(session, env.state, self.step_timeout_s)

    # -- idle reaper ---------------------------------------------------------------

    async def reap_idle(self) -> int:
        """Close sessions idle longer than ``idle_ttl_s``; answers how many it closed."""
        now = time.monotonic()
        idle = [
            s
            for s in self.sessions.values()
            if now - s.last_used > self.idle_ttl_s and not s.lock.locked()
        ]
        for session in idle:
            log.info("reaping idle session %s (%s)", session.id, session.env_name)
            await self._drop(session)
        return len(idle)

    def start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever())

    async def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(self.idle_ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_idle()
            except Exception:  # the reaper must outlive one bad env
                log.exception("idle reaper failed")
