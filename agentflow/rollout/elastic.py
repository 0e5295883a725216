"""`ElasticPool`: how many episodes run at once, adapted to measured load
(docs/architecture.md, "Asynchrony and staleness").

An episode alternates between generating (it needs the engine) and waiting on its env
(it does not). To keep the engine's batch full, the pool wants enough live episodes that,
on average, `engine_slots` of them are generating: by Little's law that is
`engine_slots / generating_fraction`, where the fraction is measured (the time-average
of in-flight generations over live episodes). Each tick moves the limit halfway to that
target, within `[min_concurrency, max_concurrency]` (the configured caps; per-env caps
still apply on top). When the engine has requests waiting for a slot the target is not
raised: more episodes would only queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class ElasticLimit:
    """A semaphore whose capacity can move; lowering it never interrupts holders.

    Waiters are futures woken together on each change (each looks again), not a
    `Condition`: a release happens at every episode's end, and notifying a condition
    from there took a task of its own, for a waiter that is there only while the pool
    is full."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        while self.held >= self.limit:
            woken = asyncio.get_running_loop().create_future()
            self._waiters.append(woken)
            try:
                await woken
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):  # absent once a change woke it
                    self._waiters.remove(woken)
                raise
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            woken = self._waiters.popleft()
            if not woken.done():
                woken.set_result(None)


class ElasticPool:
    def __init__(
        self,
        limit: ElasticLimit,
        *,
        min_concurrency: int,
        max_concurrency: int,
        engine_slots: Callable[[], Awaitable[tuple[int, int]]],
        generating: Callable[[], float],
        interval_s: float = 0.5,
    ) -> None:
        """`engine_slots()` -> (decode slots, requests waiting for one);
        `generating()` -> mean in-flight generations since the last call."""
        self.limit = limit
        self.min_concurrency = min_concurrency
        self.max_concurrency = max_concurrency
        self.engine_slots = engine_slots
        self.generating = generating
        self.interval_s = interval_s
        self.history: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="elastic-pool")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def tick(self) -> int:
        live = max(self.limit.held, 1)
        generating = self.generating()
        slots, waiting = await self.engine_slots()
        fraction = min(max(generating / live, 0.02), 1.0)
        target = slots / fraction
        if waiting > 0:
            target = min(target, self.limit.limit)
        target = max(self.min_concurrency, min(self.max_concurrency, target))
        new = round((self.limit.limit + target) / 2)
        new = max(self.min_concurrency, min(self.max_concurrency, new))
        self.limit.set_limit(new)
        self.history.append(new)
        return new

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a failed measurement keeps the old limit
                log.exception("elastic pool tick failed")
