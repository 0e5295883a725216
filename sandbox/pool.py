"""A warm pool of sandboxes: started ahead of time, handed out, then recycled or replaced.

Starting a sandbox can be slow (a container takes a second or more), so the pool keeps
up to ``size`` idle ones ready. ``acquire()`` hands one out; at most ``max_active`` are
out at once (further callers wait). On release a sandbox is reset and put back when
``recycle`` is on and the backend can reset; otherwise it is closed and a fresh one is
started in the background, which is what one-shot use (the HTTP service) wants.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sandbox.base import Sandbox, SandboxError

log = logging.getLogger(__name__)


class SandboxPool:
    def __init__(
        self,
        factory: Callable[[], Sandbox],
        *,
        size: int = 2,
        max_active: int = 8,
        recycle: bool = False,
    ) -> None:
        if not 0 <= size <= 256:
            raise ValueError("size must be between 0 and 256")
        if not 1 <= max_active <= 4096:
            raise ValueError("max_active must be between 1 and 4096")
        self._factory = factory
        self.size = size
        self.max_active = max_active
        self.recycle = recycle
        self._idle: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._slots = asyncio.Semaphore(max_active)
        self._refills: set[asyncio.Task[None]] = set()
        self._closed = False
        self.active = 0

    @property
    def idle(self) -> int:
        return self._idle.qsize()

    async def start(self) -> None:
        """Fill the pool; raises if the backend cannot start a single sandbox."""
        await asyncio.gather(*(self._add_one() for _ in range(self.size - self.idle)))

    async def _add_one(self) -> None:
        sandbox = await asyncio.to_thread(self._factory)
        if self._closed or self.idle >= self.size:
            await sandbox.close()
            return
        self._idle.put_nowait(sandbox)

    def _refill(self) -> None:
        if self._closed or self.idle + len(self._refills) >= self.size:
            return
        task = asyncio.create_task(self._add_one())
        self._refills.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._refills.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("could not start a warm sandbox: %s", t.exception())

        task.add_done_callback(done)

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """Borrow a sandbox for the duration of the ``async with`` block."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        async with self._slots:
            try:
                sandbox = self._idle.get_nowait()
            except asyncio.QueueEmpty:
                sandbox = await asyncio.to_thread(self._factory)
            self.active += 1
            try:
                yield sandbox
            finally:
                self.active -= 1
                await self._release(sandbox)

    async def _release(self, sandbox: Sandbox) -> None:
        reset: Any = getattr(sandbox, "reset", None)
        if self.recycle and reset is not None and not self._closed and self.idle < self.size:
            try:
                await reset()
            except Exception as exc:  # a broken sandbox is replaced, never handed out again
                log.warning("sandbox reset failed, replacing it: %s", exc)
            else:
                self._idle.put_nowait(sandbox)
                return
        await sandbox.close()
        self._refill()

    async def close(self) -> None:
        """Close idle sandboxes and stop refilling; borrowed ones close on release."""
        self._closed = True
        # Refills are not cancelled: a factory call already running in a thread would leak
        # its sandbox. They see ``_closed`` when done and close what they made.
        await asyncio.gather(*self._refills, return_exceptions=True)
        while not self._idle.empty():
            await self._idle.get_nowait().close()
