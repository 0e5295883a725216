"""Group commit: concurrent single writes share one batch write.

Rollouts write one turn, one new episode, one finished episode at a time from many
concurrent episodes. One transaction per write costs several round trips, a commit and
the statement's overhead each, which caps a process at a few hundred writes per second.
Here every call queues its item and awaits its own future; one drain task writes whatever
has queued up as a single batch, then the next batch, and exits when the queue is empty.
Nothing waits on a timer: a lone call is written at once, and under load the batch grows
by itself while the previous one is being written. With `linger_s`, the drain task stays
that long after its last batch for more calls (written at once when they come), so that
what it holds between batches (a database connection, `on_idle` gives it back) is not
given back and taken again between every two writes of a steady trickle.

Below saturation that rule writes nearly every call alone: a thousand live episodes
send a few hundred turns a second, each arriving while the event loop is idle, and a
statement per call costs more CPU than the rows. A call that nobody waits on at once
(`submit(item, gather=True)`: a turn the episode goes on past) may wait up to `gather_s`
after its submission for others to share its batch; the batch is written when its
oldest gathering call has waited that long, when it is full, or as soon as a call that
does not gather joins it (an API call waiting on its write).

A batch write returns one result per item, an exception among them failing that item
alone (an episode already finished, say). A batch write that raises is written again
one item at a time, in order, so that each caller gets its own item's error and good
items are not refused for a neighbour's mistake.
"""

from __future__ import annotations

import asyncio
import bisect
import math
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

    def __init__(
        self,
        write_batch: WriteBatch[Item, Result],
        *,
        max_batch: int = 500,
        linger_s: float = 0.0,
        gather_s: float = 0.0,
        on_idle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._gather_s = gather_s
        self._on_idle = on_idle
        # Each queued call: its item, its future, and when it was submitted (loop time).
        self._pending: list[tuple[Item, asyncio.Future[Result], float]] = []
        self._due = math.inf  # loop time by which what is queued must be written
        self._hurry: asyncio.Future[bool] | None = None  # set while the drain gathers
        self._draining = False  # a drain task takes what is queued (or lingers for it)
        self._drain_task: asyncio.Task[None] | None = None  # the loop keeps tasks weakly
        self._more: asyncio.Future[bool] | None = None  # set while the drain lingers
        self.waits = WaitHistogram()  # submit to commit, per call

    @property
    def queued(self) -> int:
        """Items waiting for a batch (the one being written not counted)."""
        return len(self._pending)

    def submit(self, item: Item, *, gather: bool = False) -> asyncio.Future[Result]:
        """Queue `item` now (so items queued later are written after it); the future
        resolves once it is committed, or carries its own error. With `gather`, its
        write may wait up to `gather_s` for others to share the batch."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        submitted = loop.time()
        self._pending.append((item, future, submitted))
        due = submitted + self._gather_s if gather else submitted
        if due < self._due or len(self._pending) >= self._max_batch:
            self._due = min(self._due, due)
            _wake(self._hurry)
        if not self._draining:
            self._draining = True
            self._drain_task = asyncio.create_task(self._drain())
        else:
            _wake(self._more)
        return future

    def hurry(self) -> None:
        """Make what is queued due now: someone waits on a write that gathers after all
        (an episode's window of unfinished writes is full, or it ends alone)."""
        if self._pending:
            self._due = -math.inf
            _wake(self._hurry)

    async def add(self, item: Item, *, gather: bool = False) -> Result:
        """Write `item`; its result once committed, or its own error."""
        return await self.submit(item, gather=gather)

    async def _drain(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Result], float]] = []
        try:
            while True:
                while self._pending:
                    await self._gather()
                    batch = self._pending[: self._max_batch]
                    del self._pending[: self._max_batch]
                    # What stays queued (past a full batch) is written next, at once.
                    self._due = -math.inf if self._pending else math.inf
                    await self._write(batch)
                batch = []
                more = self._linger_s > 0 and await self._more_within(self._linger_s)
                if not more and not self._pending:
                    break
            self._draining = False  # from here a submit starts a new drain
        except BaseException:  # cancelled (the loop is closing): no caller may wait forever
            self._draining = False
            for _, future, _ in batch + self._pending:
                future.cancel()
            self._pending.clear()
            self._due = math.inf
            raise
        finally:
            if self._on_idle is not None:
                await self._on_idle()

    async def _gather(self) -> None:
        """Until what is queued is due: its oldest gathering call has waited `gather_s`,
        a call that does not gather came, or a batch is full."""
        loop = asyncio.get_running_loop()
        while len(self._pending) < self._max_batch:
            left = self._due - loop.time()
            if left <= 0:
                return
            self._hurry = hurry = loop.create_future()
            timer = loop.call_later(left, _settle, hurry, False)
            try:
                await hurry
            finally:
                timer.cancel()
                self._hurry = None

    async def _more_within(self, seconds: float) -> bool:
        """Whether an item is submitted within `seconds`."""
        loop = asyncio.get_running_loop()
        self._more = more = loop.create_future()
        timer = loop.call_later(seconds, _settle, more, False)
        try:
            return await more
        finally:
            timer.cancel()
            self._more = None

    async def _write(self, batch: list[tuple[Item, asyncio.Future[Result], float]]) -> None:
        try:
            results: Sequence[Result | BaseException] = await self._write_batch(
                [item for item, _, _ in batch]
            )
        except Exception as exc:
            if len(batch) > 1:
                for entry in batch:  # find whose item failed; earlier items still go first
                    await self._write([entry])
                return
            results = [exc]
        if len(results) != len(batch):
            raise AssertionError(f"a batch of {len(batch)} got {len(results)} results")
        # Timed here, not by a callback on each future: a callback is one more event-loop
        # handle per call, and the wait is the same.
        now = asyncio.get_running_loop().time()
        for (_, future, submitted), result in zip(batch, results, strict=True):
            _settle(future, result)
            self.waits.add(now - submitted)


def _wake(waiting: asyncio.Future[bool] | None) -> None:
    """Wake the drain where it waits (to gather, or lingering) for a submit."""
    if waiting is not None and not waiting.done():
        waiting.set_result(True)


def _settle(future: asyncio.Future[Result], outcome: Result | BaseException) -> None:
    if future.done():  # the caller was cancelled; its item may still have been written
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
