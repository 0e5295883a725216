"""Where the episode loop's turns go (`agentflow.agents.episode.Recorder`).

- `TurnTreeRecorder`: the episode's turn tree in the database. Writes are queued as each
  turn completes and committed in the background (concurrent episodes share commits), so
  the loop does not wait on the database between turns.
- `MemoryRecorder`: the episode as flat lists (tokens, loss mask, log-probs), for
  evaluation and supervised data, where nothing is stored.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from agentflow.db.turn_tree import TurnTree
from agentflow.types import StoredTurn, TurnRecord


class TurnTreeRecorder:
    """Appends an episode's turns under `parent` (None: a new root). A failed write fails
    the episode at the next record or at the end.

    How many writes may be outstanding before the loop waits on the oldest: `window`
    while nothing but this episode's writes is queued, and `shared_window` while other
    episodes' writes are queued too. Alone, a fast episode's writes go at once when half
    its window is queued, so its next turns overlap the write instead of stalling on a
    full window, and each write carries half a window. Among others, the small window is
    the writer's backpressure: when the database falls behind, each episode stops after
    a few unwritten turns, which bounds the queue (and the memory it holds) at a few
    turns per live episode.

    A policy turn is held back until the env's answer to it is recorded, or `hold_s` has
    passed, whichever comes first, so that a fast env's turn and the reply before it go
    to the database as one write instead of two; a slow env's wait does not keep the
    reply from being stored."""

    def __init__(
        self,
        turns: TurnTree,
        episode_id: uuid.UUID,
        *,
        parent: uuid.UUID | None = None,
        window: int = 16,
        shared_window: int = 4,
        hold_s: float = 0.05,
    ) -> None:
        self.turns = turns
        self.episode_id = episode_id
        self.last: uuid.UUID | None = parent  # the newest turn submitted
        self.window = window
        self.shared_window = min(shared_window, window)
        self.hold_s = hold_s
        self.pending: list[asyncio.Future[None]] = []
        self._held: TurnRecord | None = None
        self._held_until: asyncio.TimerHandle | None = None

    async def record(self, record: TurnRecord) -> None:
        outstanding = len(self.pending)
        if outstanding >= self.window or (
            outstanding >= self.shared_window and self.turns.turns_queued > outstanding
        ):
            self.turns.hurry_turns()  # waited on now: not worth gathering for
            # Shielded: a cancel must not cancel the write itself, which `settle` awaits.
            await asyncio.shield(self.pending[0])
        while self.pending and self.pending[0].done():  # writes commit in order
            self.pending.pop(0).result()  # a failed write raises here, in the loop
        self._submit_held()
        if record.kind == "policy" and self.hold_s > 0:
            self._held = record
            self._held_until = asyncio.get_running_loop().call_later(self.hold_s, self._submit_held)
        else:
            self._submit(record)
        # Half a window queued (the batch being written not counted): written now, if
        # nothing but this episode's writes is queued. Counted by what is queued, not by
        # what is outstanding, so that a fast episode's next writes gather while a batch
        # is written instead of each going alone the moment it is queued.
        if self.turns.turns_queued >= self.window // 2:
            self.turns.hurry_turns(at_most=len(self.pending))

    def _submit(self, record: TurnRecord) -> None:
        turn_id, committed = self.turns.submit_turn(self.episode_id, self.last, record)
        self.pending.append(committed)
        self.last = turn_id

    def _submit_held(self) -> None:
        if self._held_until is not None:
            self._held_until.cancel()
            self._held_until = None
        if self._held is not None:
            held, self._held = self._held, None
            self._submit(held)

    async def settle(self) -> None:
        """Wait until every queued write is committed (or failed); a cancel that arrives
        meanwhile is raised once they are, never instead."""
        self._submit_held()
        pending, self.pending = self.pending, []
        # Most are committed by now: only the rest are waited on (each future gathered
        # costs an event-loop callback).
        waiting = [write for write in pending if not write.done()]
        if waiting:
            # Hurried only when nothing but these writes is queued (one episode at a time:
            # no one to share a batch with). Among other episodes' writes the end waits the
            # moment they gather for: a batch for each episode's end would undo the
            # gathering.
            self.turns.hurry_turns(at_most=len(waiting))
            done = asyncio.gather(*waiting, return_exceptions=True)
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                await done
                raise
        # The first failure in submission order; every failure is looked at, so none is
        # reported as never retrieved.
        failures = [
            asyncio.CancelledError() if write.cancelled() else write.exception()
            for write in pending
        ]
        for failure in failures:
            if failure is not None:
                raise failure


class MemoryRecorder:
    """The episode's tokens with their loss mask and log-probs (0.0 off-policy), as the
    turn tree's `context` of its leaf would read."""

    def __init__(self, start: Sequence[StoredTurn] = ()) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.records: list[TurnRecord] = []
        for turn in start:
            self._append(turn.token_ids, turn.loss_mask, turn.logprobs)

    def _append(
        self, ids: Sequence[int], mask: Sequence[int] | None, logprobs: Sequence[float] | None
    ) -> None:
        self.token_ids += ids
        self.loss_mask += mask if mask is not None else [0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    async def record(self, record: TurnRecord) -> None:
        self.records.append(record)
        self._append(record.token_ids, record.loss_mask, record.logprobs)

    async def settle(self) -> None:
        return None
