"""`StalenessGate`: how far rollout may run ahead of the trainer (docs/architecture.md,
"Asynchrony and staleness").

The unit is a *group* (the `group_size` samples of one task, which the trainer needs
together for group-normalized advantages). With `G` groups per trainer batch, at most
`(version + max_staleness + 1) * G` groups are ever admitted while the trainer is at
`version`: so nothing is generated more than `max_staleness` versions ahead of the
policy that will train on it (AReaL's bound). With replay the trainer can step (and
advance the version) on replayed data, which would let that bound run ahead of what it
actually consumes; so admission is also held to `taken + (max_staleness + 1) * G`,
where `taken` counts fresh groups the trainer has leased (counted at the lease, not the
acknowledgement, because a trainer acknowledges only at its checkpoints).

A group that ends with no trajectory (every episode failed or was dropped as stale) is
refunded, so the trainer is never left waiting for data that cannot come.
`max_staleness = 0` is the synchronous schedule: one batch, then a barrier until the
trainer has stepped.
"""

from __future__ import annotations

import asyncio
import math


class StalenessGate:
    def __init__(
        self, *, max_staleness: int, batch_episodes: int, group_size: int, version: int = 0
    ) -> None:
        self.max_staleness = max_staleness
        self.groups_per_batch = max(1, math.ceil(batch_episodes / group_size))
        self.version = version
        self.admitted = 0  # groups admitted, refunds subtracted
        self.taken = 0  # fresh groups the trainer has leased
        self.refunded = 0
        self._changed = asyncio.Condition()

    @property
    def limit(self) -> int:
        ahead = (self.max_staleness + 1) * self.groups_per_batch
        return min(self.version * self.groups_per_batch, self.taken) + ahead

    def open(self) -> bool:
        return self.admitted < self.limit

    async def admit_group(self) -> None:
        """Wait until a group may start, and count it."""
        async with self._changed:
            await self._changed.wait_for(self.open)
            self.admitted += 1

    async def refund_group(self) -> None:
        async with self._changed:
            self.admitted -= 1
            self.refunded += 1
            self._changed.notify_all()

    async def groups_taken(self, n: int) -> None:
        async with self._changed:
            self.taken += n
            self._changed.notify_all()

    async def advance(self, version: int) -> None:
        """The trainer published `version`: admit up to the new bound."""
        async with self._changed:
            self.version = max(self.version, version)
            self._changed.notify_all()

    def resume_from(self, version: int, groups_done: int, taken: int) -> None:
        """After a restart: the trainer is at `version`, `groups_done` groups exist and
        the trainer has taken `taken` of them."""
        self.version = version
        self.admitted = groups_done
        self.taken = taken
