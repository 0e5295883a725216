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
    """Appends an episode's turns under `parent` (None: a new root). At most `window`
    writes may be outstanding; a failed write fails the episode at the next record or at
    the end."""

    def __init__(
        self,
        turns: TurnTree,
        episode_id: uuid.UUID,
        *,
        parent: uuid.UUID | None = None,
        window: int = 4,
    ) -> None:
        self.turns = turns
        self.episode_id = episode_id
        self.last: uuid.UUID | None = parent  # the newest turn recorded
        self.window = window
        self.pending: list[asyncio.Future[None]] = []

    async def record(self, record: TurnRecord) -> None:
        if len(self.pending) >= self.window:
            # Shielded: a cancel must not cancel the write itself, which `settle` awaits.
            await asyncio.shield(self.pending[0])
        while self.pending and self.pending[0].done():  # writes commit in order
            self.pending.pop(0).result()  # a failed write raises here, in the loop
        turn_id, committed = self.turns.submit_turn(self.episode_id, self.last, record)
        self.pending.append(committed)
        self.last = turn_id

    async def settle(self) -> None:
        """Wait until every queued write is committed (or failed); a cancel that arrives
        meanwhile is raised once they are, never instead."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        done = asyncio.gather(*pending, return_exceptions=True)
        try:
            results = await asyncio.shield(done)
        except asyncio.CancelledError:
            await done
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result


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
