"""Group commit: concurrent single writes share one batch write.

Rollouts write one turn, one new episode, one finished episode at a time from many
concurrent episodes. One transaction per write costs several round trips, a commit and
the statement's overhead each, which caps a process at a few hundred writes per second.
Here every call queues its item and awaits its own future; one drain task writes whatever
has queued up as a single batch, then the next batch, and exits when the queue is empty.
Nothing waits on a timer: a lone call is written at once, and under load the batch grows
by itself while the previous one is being written.

A batch write returns one result per item, an exception among them failing that item
alone (an episode already finished, say). A batch write that raises is written again
one item at a time, in order, so that each caller gets its own item's error and good
items are not refused for a neighbour's mistake.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

WriteBatch = Callable[[Sequence[Item]], Awaitable[Sequence[Result | Exception]]]

# Upper edges (seconds) of the wait histogram's buckets; the last bucket is open.
WAIT_EDGES_S: tuple[float, ...] = tuple(0.0005 * 2**i for i in range(18))  # 0.5 ms .. 65 s


class WaitHistogram:
    """How long calls waited for their write (queued, then written), in doubling buckets:
    cheap per call, and two snapshots subtract to a window."""

    def __init__(self) -> None:
        self.counts = [0] * (len(WAIT_EDGES_S) + 1)

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_EDGES_S, seconds)] += 1

    def snapshot(self) -> list[int]:
        return list(self.counts)

    @staticmethod
    def quantile(counts: Sequence[int], q: float) -> float | None:
        """The upper edge of the bucket holding quantile `q` (inf for the open one)."""
        total = sum(counts)
        if not total:
            return None
        seen = 0
        for index, count in enumerate(counts):
            seen += count
            if seen >= q * total:
                return WAIT_EDGES_S[index] if index < len(WAIT_EDGES_S) else float("inf")
        return float("inf")


class GroupCommit(Generic[Item, Result]):
    """Coalesces concurrent single writes into `write_batch` calls (one event loop).

    `write_batch(items)` returns one entry per item, in order: its result, or the
    exception that item alone fails with."""

    def __init__(self, write_batch: WriteBatch[Item, Result], *, max_batch: int = 500) -> None:
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self.waits = WaitHistogram()  # submit to commit, per call

    @property
    def queued(self) -> int:
        """Items waiting for a batch (the one being written not counted)."""
        return len(self._pending)

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """Queue `item` now (so items queued later are written after it); the future
        resolves once it is committed, or carries its own error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        submitted = loop.time()
        future.add_done_callback(lambda _: self.waits.add(loop.time() - submitted))
        self._pending.append((item, future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.create_task(self._drain())
        return future

    async def add(self, item: Item) -> Result:
        """Write `item`; its result once committed, or its own error."""
        return await self.submit(item)

    async def _drain(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
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

    async def _write(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self._write_batch([item for item, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            for entry in batch:  # find whose item failed; earlier items still go first
                await self._write([entry])
            return
        if len(results) != len(batch):
            raise AssertionError(f"a batch of {len(batch)} got {len(results)} results")
        for (_, future), result in zip(batch, results, strict=True):
            _settle(future, result)


def _settle(future: asyncio.Future[Result], outcome: Result | BaseException) -> None:
    if future.done():  # the caller was cancelled; its item may still have been written
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
