"""Group commit for single turns: concurrent `add_turn` calls share one transaction.

Rollouts add one turn at a time from many concurrent episodes. One transaction per turn
costs several round trips and a commit each, which caps a process at a few hundred
turns per second. Here every call queues its turn and awaits its own future; one drain
task writes whatever has queued up as a single batch, then the next batch, and exits
when the queue is empty. Nothing waits on a timer: a lone call is written at once, and
under load the batch grows by itself while the previous one is being written.

A failed batch is written again one turn at a time, in order, so that each caller gets
its own turn's error and good turns are not refused for a neighbour's mistake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from agentflow.types import NewTurn

WriteBatch = Callable[[Sequence[NewTurn]], Awaitable[object]]


class TurnBatcher:
    """Coalesces concurrent single-turn writes into `write_batch` calls (one event loop)."""

    def __init__(self, write_batch: WriteBatch, *, max_batch: int = 500) -> None:
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._pending: list[tuple[NewTurn, asyncio.Future[None]]] = []
        self._drain_task: asyncio.Task[None] | None = None

    def submit(self, turn: NewTurn) -> asyncio.Future[None]:
        """Queue `turn` now (so turns queued later are written after it); the future
        resolves once it is committed, or carries its own error."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((turn, future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.create_task(self._drain())
        return future

    async def add(self, turn: NewTurn) -> None:
        """Write `turn`; returns once it is committed, raises its own error if it is not."""
        await self.submit(turn)

    async def _drain(self) -> None:
        batch: list[tuple[NewTurn, asyncio.Future[None]]] = []
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                await self._write(batch)
        except BaseException:  # cancelled (the loop is closing): no caller may wait forever
            for _, future in batch + self._pending:
                future.cancel()
            self._pending.clear()
            raise

    async def _write(self, batch: list[tuple[NewTurn, asyncio.Future[None]]]) -> None:
        try:
            await self._write_batch([turn for turn, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            for item in batch:  # find whose turn failed; parents still precede children
                await self._write([item])
            return
        for _, future in batch:
            _settle(future, None)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled; its turn may still have been written
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
