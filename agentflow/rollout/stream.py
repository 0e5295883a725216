"""The trajectory stream (docs/architecture.md, "Protocols"): how completed trajectories
reach the trainer.

The database is the source of truth, so nothing is lost when either side dies:
- `pull(max_n, timeout, min_n=1)` leases up to `max_n` trajectories for `lease_s`:
  whole groups (a task's samples go together, for group-normalized advantages), only
  groups whose episodes have all finished, oldest first. Fresh trajectories always come
  first; replays (ReFlow) fill in only when fresh ones are short, each trajectory at most
  `max_reuse` times and only while inside the staleness bound. A pull waits up to
  `timeout` for `min_n`: short of them, it keeps what it leased and looks again once
  this process has made as many as it still needs, or after `poll_s`; woken by new
  trajectories it waits `linger_s` (0.1 s) for more before it leases. A trainer that
  asks for its whole batch at once costs a lease transaction per poll, not one per
  batch of episode ends.
- `ack(ids, lease_id)` records that the trainer's step with them committed. It counts
  once per lease: a repeated ack is a no-op, and an ack after the lease expired still
  counts (a trainer that committed its step and died before acknowledging acks its
  checkpointed batch on restart), as long as nobody leased the trajectory since.
- A lease that expires unacknowledged makes its trajectories servable again.
- Staleness is `trainer version - min(token versions)`; past `max_staleness` a
  trajectory is dropped (status `stale`) or served with `loss_weight =
  1 / (1 + excess)` (`downweight`), and counted either way.
- `reject(id, lease_id, error)` records why the trainer refused a trajectory.

`DbTrajectoryStream` is the in-process form; `HttpTrajectoryStream` speaks the gateway's
`POST /v1/runs/{id}/trajectories/lease` and `.../ack` routes, which run the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, cast

import orjson
from sqlalchemy import Table, update
from sqlalchemy.ext.asyncio import AsyncConnection

from agentflow import ids
from agentflow.db.models import Trajectory as TrajectoryRow
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import AgentFlowError, Conflict, InvalidInput, NotFound
from agentflow.rollout import stream_sql
from agentflow.rollout.gate import StalenessGate
from agentflow.types import Trajectory

_trajectories = cast(Table, TrajectoryRow.__table__)

StalePolicy = Literal["drop", "downweight"]
LEASE_ID = re.compile(r"[0-9a-f]{32}")


class TrajectoryStream(Protocol):
    async def pull(
        self, max_n: int, timeout: float = 0.0, lease_id: str | None = None, min_n: int = 1
    ) -> list[Trajectory]: ...

    async def ack(self, ids: Sequence[uuid.UUID], lease_id: str | None = None) -> int: ...

    async def reject(self, trajectory_id: uuid.UUID, lease_id: str | None, error: str) -> None: ...

    async def reclaim(self) -> int: ...


@dataclasses.dataclass
class StreamCounters:
    served_fresh: int = 0
    served_replay: int = 0
    dropped_stale: int = 0
    downweighted: int = 0
    expired_leases: int = 0
    acked: int = 0
    rejected: int = 0
    staleness: Counter[int] = dataclasses.field(default_factory=Counter)  # of served samples


class DbTrajectoryStream:
    """The stream of one run, over its `TurnTree`'s database."""

    def __init__(
        self,
        turns: TurnTree,
        run_id: uuid.UUID,
        *,
        group_size: int = 1,
        max_staleness: int | None = None,
        max_reuse: int = 1,
        stale_policy: StalePolicy = "drop",
        lease_s: float = 600.0,
        poll_s: float = 0.5,
        linger_s: float = 0.1,
        gate: StalenessGate | None = None,
    ) -> None:
        """`gate`: the run scheduler's staleness gate, told of every group a pull hands
        out for the first time, and of every group whose trajectories were all dropped
        as stale (so it admits another). `linger_s`: how long a waiting pull, woken by
        new trajectories, waits for more before it leases (one lease then takes what
        several batches of episode ends made, instead of a lease transaction each)."""
        if max_reuse < 1:
            raise InvalidInput("max_reuse must be >= 1", field="max_reuse")
        self.turns = turns
        self.run_id = run_id
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.stale_policy = stale_policy
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.linger_s = linger_s
        self.counters = StreamCounters()
        self.gate = gate
        self._run = {"p_run_id": run_id}  # the parameter of every statement of the run

    # ---- pull -----------------------------------------------------------------------

    async def pull(
        self, max_n: int, timeout: float = 0.0, lease_id: str | None = None, min_n: int = 1
    ) -> list[Trajectory]:
        """Lease up to `max_n` trajectories, waiting up to `timeout` s for at least `min_n`
        (fewer come back only when the time is up; `min_n` is cut to the whole groups
        that fit in `max_n`).

        A pull short of `min_n` keeps what it leased and looks again once this process has
        made as many trajectories as it still needs, or after `poll_s` (other processes
        make them too): a trainer filling a batch of hundreds asks for all of it at once
        and costs a lease transaction per poll, not one per batch of episode ends.

        `lease_id` (32 hex digits, the caller's) makes a resent pull safe: when
        trajectories are still leased under it, the pull whose answer was lost did lease
        them, and they are served again (the lease renewed) instead of leasing more."""
        if max_n < 1:
            raise InvalidInput("max_n must be >= 1", field="max_n")
        if not 1 <= min_n <= max_n:
            raise InvalidInput("min_n must be in [1, max_n]", field="min_n")
        if not 0 <= timeout <= 3600:
            raise InvalidInput("timeout must be in [0, 3600] seconds", field="timeout")
        if lease_id is not None and not LEASE_ID.fullmatch(lease_id):
            raise InvalidInput("lease_id must be 32 lowercase hex digits", field="lease_id")
        if max_n >= self.group_size:  # only whole groups fit: never wait for a part of one
            min_n = min(min_n, max_n - max_n % self.group_size)
        resendable = lease_id is not None  # only a caller's own id can be held already
        lease_id = lease_id or ids.new_hex()
        deadline = time.monotonic() + timeout
        got: list[Trajectory] = []
        while True:
            # Both taken before looking: no lost wake-up.
            added = self.turns.trajectories_added()
            made = self.turns.trajectories_made
            # Only the first look may find a resent pull's trajectories; later ones would
            # find this pull's own.
            got += await self._lease(max_n - len(got), lease_id, resendable=resendable)
            resendable = False
            now = time.monotonic()
            if len(got) >= min_n or now >= deadline:
                return got
            # Short: look again once this process has made what is missing, or after a poll.
            until = min(deadline, now + self.poll_s)
            woken = await self._await_made(made + min_n - len(got), added, until=until)
            if woken and self.linger_s > 0:
                await asyncio.sleep(min(self.linger_s, max(0.0, deadline - time.monotonic())))

    async def _await_made(self, total: int, added: asyncio.Event, *, until: float) -> bool:
        """Wait until this process has made `total` trajectories in all, or until the
        monotonic time `until`; returns whether any were made meanwhile (`added` set)."""
        woken = False
        while self.turns.trajectories_made < total:
            left = until - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(added.wait(), left)
            if added.is_set():
                woken = True
                added = self.turns.trajectories_added()
        return woken

    async def _lease(self, max_n: int, lease_id: str, *, resendable: bool) -> list[Trajectory]:
        now = datetime.now(UTC)
        if resendable:
            async with self.turns.write_transaction() as session:
                conn = await session.connection()
                held = await self._renew(conn, lease_id, now)
                if held:
                    version = await conn.scalar(stream_sql.VERSION, self._run)
            if held:
                return await self._serve(held, lease_id, version or 0)
        for attempt in range(_LEASE_ATTEMPTS):
            try:
                taking = await self._take(max_n, lease_id, now)
                break
            except _LeaseRace:  # another leaser took some of the rows first: look again
                if attempt == _LEASE_ATTEMPTS - 1:
                    return []  # the caller's next poll looks again
        chosen, n_fresh, version, expired, dropped, dropped_groups = taking
        self.counters.expired_leases += expired
        self.counters.dropped_stale += dropped
        # Groups taken for the first time (an expired or reclaimed lease keeps its id).
        taken = {row.group_id or row.id for row in chosen[:n_fresh] if row.lease_id is None}
        if self.gate is not None:
            for _ in range(dropped_groups):
                await self.gate.refund_group()
            if taken:
                await self.gate.groups_taken(len(taken))
        if not chosen:
            return []
        served = await self._serve([row.id for row in chosen], lease_id, version, count=True)
        self.counters.served_fresh += n_fresh
        self.counters.served_replay += len(chosen) - n_fresh
        return served

    async def _take(
        self, max_n: int, lease_id: str, now: datetime
    ) -> tuple[list[Any], int, int, int, int, int]:
        """One lease transaction: expired leases back to ready, stale ones dropped, whole
        groups chosen and leased. Only the chosen rows are locked, by the UPDATE that
        leases them; one that another leaser took meanwhile is missing from its count,
        and the transaction is rolled back (`_LeaseRace`) rather than split a group.
        Returns the chosen rows, how many are fresh, the run's version, and the expired,
        dropped and wiped-out-group counts."""
        dropped = dropped_groups = 0
        async with self.turns.write_transaction() as session:
            # Core on the session's connection: the ORM's execute costs more than the
            # statements here, and they need nothing of it.
            conn = await session.connection()
            expired = await conn.execute(stream_sql.EXPIRE, {**self._run, "p_now": now})
            version = await conn.scalar(stream_sql.VERSION, self._run)
            if version is None:
                raise NotFound(f"run {self.run_id} not found")
            bound = None if self.max_staleness is None else version - self.max_staleness
            # Dropped, the rows past the bound are no candidates; they are marked stale
            # after the candidates are read, so a group that ended in between is dropped
            # from too, and what is served and what is marked stale agree.
            drop_below = bound if self.stale_policy == "drop" else None
            fresh = await self._candidates(conn, fresh=True, bound=drop_below, max_n=max_n)
            if drop_below is not None:
                dropped, dropped_groups = await self._drop_stale(conn, drop_below)
            chosen = _whole_groups(fresh, max_n)
            n_fresh = len(chosen)
            if len(chosen) < max_n and self.max_reuse > 1:
                left = max_n - len(chosen)
                replay = await self._candidates(conn, fresh=False, bound=bound, max_n=left)
                chosen += _whole_groups(replay, left)
            ids = [row.id for row in chosen]
            lease = {"p_lease_id": lease_id, "p_until": now + timedelta(seconds=self.lease_s)}
            take = stream_sql.LEASE.on(conn)
            leased = 0
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                leased += _rowcount(await conn.execute(take, {**lease, "p_ids": chunk}))
            if leased != len(ids):
                raise _LeaseRace
        return chosen, n_fresh, version, _rowcount(expired), dropped, dropped_groups

    async def _renew(self, conn: AsyncConnection, lease_id: str, now: datetime) -> list[uuid.UUID]:
        """The ids still leased under `lease_id`, their lease renewed."""
        held = list(
            (await conn.scalars(stream_sql.HELD, {**self._run, "p_lease_id": lease_id})).all()
        )
        if held:
            until = now + timedelta(seconds=self.lease_s)
            await conn.execute(stream_sql.RENEW.on(conn), {"p_ids": held, "p_until": until})
        return held

    async def _serve(
        self, ids: list[uuid.UUID], lease_id: str, version: int, *, count: bool = False
    ) -> list[Trajectory]:
        """The leased trajectories as the trainer gets them, weighted for staleness."""
        served: list[Trajectory] = []
        for view in await self.turns.trajectories(ids):
            weight = 1.0
            staleness = view.staleness(version)
            if staleness is not None:
                if count:  # a renewed lease was counted when it was first served
                    self.counters.staleness[staleness] += 1
                if self.max_staleness is not None and staleness > self.max_staleness:
                    weight = 1.0 / (1 + staleness - self.max_staleness)
                    if count:
                        self.counters.downweighted += 1
            served.append(dataclasses.replace(view, lease_id=lease_id, loss_weight=weight))
        return served

    async def _drop_stale(self, conn: AsyncConnection, bound: int) -> tuple[int, int]:
        """Mark servable trajectories past the bound `stale`; returns how many, and the
        groups wiped out. Only groups whose episodes have all ended: a group still playing
        may yet make a trajectory inside the bound, so whether it is wiped out (and
        refunded to the gate) is known only then; it is not served before then anyway."""
        stale = (await conn.execute(stream_sql.STALE, {**self._run, "p_bound": bound})).all()
        if not stale:
            return 0, 0
        ids = [row.id for row in stale]
        for start in range(0, len(ids), 500):
            await conn.execute(stream_sql.MARK_STALE.on(conn), {"p_ids": ids[start : start + 500]})
        groups = {row.group_id for row in stale if row.group_id is not None}
        wiped = 0
        for group in groups:  # a group with nothing left to train on is refunded
            wiped += not await conn.scalar(stream_sql.GROUP_LEFT, {"p_group": group})
        return len(ids), wiped

    async def _candidates(
        self, conn: AsyncConnection, *, fresh: bool, bound: int | None, max_n: int
    ) -> list[Any]:
        """Servable rows of whole groups, in serving order, as many groups as a pull of
        `max_n` can take, inside `bound` when given (`stream_sql.FRESH`, `REPLAY`, and
        their bounded forms)."""
        params: dict[str, Any] = {
            **self._run,
            "p_group_size": self.group_size,
            "p_max_n": max_n,
        }
        if fresh:
            query = stream_sql.FRESH if bound is None else stream_sql.FRESH_BOUNDED
        else:
            params["p_max_served"] = self.max_reuse - 1
            query = stream_sql.REPLAY if bound is None else stream_sql.REPLAY_BOUNDED
        if bound is not None:
            params["p_bound"] = bound
        return list((await conn.execute(query, params)).all())

    async def reclaim(self) -> int:
        """A trainer starting up owns the run's stream: leases its dead predecessor held
        go back to `ready` at once instead of after `lease_s` (their lease ids stay, so a
        checkpointed batch can still be acknowledged). Returns how many came back."""
        async with self.turns.write_transaction() as session:
            result = await (await session.connection()).execute(stream_sql.RECLAIM, self._run)
        return _rowcount(result)

    # ---- ack / reject ---------------------------------------------------------------

    async def ack(self, ids: Sequence[uuid.UUID], lease_id: str | None = None) -> int:
        """Count one training of each id under `lease_id` (default: its latest lease).
        Returns how many were counted now; repeats count zero."""
        if not ids:
            return 0
        counted = 0
        params: dict[str, Any] = {**self._run, "p_max_reuse": self.max_reuse}
        statement = stream_sql.ACK
        if lease_id is not None:
            statement = stream_sql.ACK_LEASE
            params["p_lease_id"] = lease_id
        async with self.turns.write_transaction() as session:
            conn = await session.connection()
            query = statement.on(conn)
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                counted += _rowcount(await conn.execute(query, {**params, "p_ids": chunk}))
        self.counters.acked += counted
        return counted

    async def reject(self, trajectory_id: uuid.UUID, lease_id: str | None, error: str) -> None:
        async with self.turns.write_transaction() as session:
            query = (
                update(_trajectories)
                .where(_trajectories.c.run_id == self.run_id)
                .where(_trajectories.c.id == trajectory_id)
                .values(status="rejected", error=error[:10_000], lease_id=None, lease_until=None)
            )
            if lease_id is not None:
                query = query.where(_trajectories.c.lease_id == lease_id)
            if _rowcount(await session.execute(query)):
                self.counters.rejected += 1


_LEASE_ATTEMPTS = 5


class _LeaseRace(Exception):
    """Another leaser took rows this lease chose; its transaction is rolled back."""


def _whole_groups(rows: list[Any], max_n: int) -> list[Any]:
    """Rows of whole groups, in order, up to `max_n` rows (a group larger than `max_n`
    is split only when nothing else was taken, so a pull never comes back empty-handed
    while data waits)."""
    groups: dict[object, list[Any]] = {}
    for row in rows:
        key = row.group_id if row.group_id is not None else row.id
        groups.setdefault(key, []).append(row)
    chosen: list[Any] = []
    for members in groups.values():
        if len(chosen) + len(members) <= max_n:
            chosen += members
        elif not chosen:
            return members[:max_n]
        if len(chosen) >= max_n:
            break
    return chosen


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


class HttpTrajectoryStream:
    """The stream of a run in a remote gateway (the split form's trainer)."""

    def __init__(self, client: Any, run_id: uuid.UUID | str) -> None:
        """`client`: an `httpx.AsyncClient` with the gateway's base URL and API key."""
        self.client = client
        self.run_id = str(run_id)

    async def _post(self, route: str, body: dict[str, Any], timeout: float) -> Any:
        response = await self.client.post(
            f"/v1/runs/{self.run_id}/trajectories/{route}", json=body, timeout=timeout + 30.0
        )
        if response.is_error:
            cls = {404: NotFound, 409: Conflict, 422: InvalidInput}.get(
                response.status_code, AgentFlowError
            )
            raise cls(f"trajectory stream {route}: HTTP {response.status_code}: {response.text}")
        return orjson.loads(response.content) if response.content else None

    async def pull(
        self, max_n: int, timeout: float = 0.0, lease_id: str | None = None, min_n: int = 1
    ) -> list[Trajectory]:
        # The lease id travels with the request, so a resent pull (its answer lost to a
        # gateway that died) gets the same trajectories back instead of leasing more.
        body = {
            "max_n": max_n,
            "min_n": min_n,
            "timeout_s": min(timeout, 60),
            "lease_id": lease_id or ids.new_hex(),
        }
        served = await self._post("lease", body, timeout)
        return [trajectory_from_json(t) for t in served["trajectories"]]

    async def ack(self, ids: Sequence[uuid.UUID], lease_id: str | None = None) -> int:
        body = {"ids": [str(i) for i in ids], "lease_id": lease_id}
        return int((await self._post("ack", body, 0.0))["acked"])

    async def reject(self, trajectory_id: uuid.UUID, lease_id: str | None, error: str) -> None:
        body = {"id": str(trajectory_id), "lease_id": lease_id, "error": error[:10_000]}
        await self._post("reject", body, 0.0)

    async def reclaim(self) -> int:
        return int((await self._post("reclaim", {}, 0.0))["reclaimed"])


def trajectory_from_json(data: dict[str, Any]) -> Trajectory:
    """The inverse of `dataclasses.asdict` after a JSON round trip."""

    def opt_uuid(value: Any) -> uuid.UUID | None:
        return None if value is None else uuid.UUID(str(value))

    return Trajectory(
        id=uuid.UUID(data["id"]),
        run_id=opt_uuid(data.get("run_id")),
        episode_id=uuid.UUID(data["episode_id"]),
        group_id=data.get("group_id"),
        leaf_turn_id=uuid.UUID(data["leaf_turn_id"]),
        reward=data.get("reward"),
        status=data["status"],
        times_served=int(data["times_served"]),
        min_weight_version=data.get("min_weight_version"),
        created_at=datetime.fromisoformat(data["created_at"]),
        turn_ids=tuple(uuid.UUID(t) for t in data["turn_ids"]),
        turn_starts=tuple(data["turn_starts"]),
        token_ids=tuple(data["token_ids"]),
        logprobs=tuple(data["logprobs"]),
        loss_mask=tuple(data["loss_mask"]),
        weight_versions=tuple(data["weight_versions"]),
        lease_id=data.get("lease_id"),
        loss_weight=float(data.get("loss_weight", 1.0)),
        env_ref=str(data.get("env_ref") or ""),
        turn_rewards=tuple(float(r) for r in data.get("turn_rewards") or ()),
    )
