"""The trajectory stream's statements, built once.

A trainer's pull runs a lease transaction each time trajectories are added (several a
second at a thousand live episodes), and a statement built per call costs more of the
gateway's CPU than the database spends running it: SQLAlchemy constructs its clauses,
column collections of the aliases and the CTE, and a cache key, before it finds the
compiled form in its cache. Built once here with bound parameters, each keeps its cache
key, and a call only binds values. Parameter names start with `p_`: SQLAlchemy reserves
a column's own name in an UPDATE's SET clause. A list of ids is one array parameter on
PostgreSQL, an expanding list on SQLite (`agentflow.db.id_lists`): a statement taking one
is built in both forms, and `.on(conn)` picks the connection's.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, bindparam, case, func, or_, select, update
from sqlalchemy.sql import Select, Update

from agentflow.db.id_lists import ByDialect, both, id_match
from agentflow.db.models import Episode, Run
from agentflow.db.models import Trajectory as TrajectoryRow
from agentflow.types import OPEN_EPISODE_STATUSES

_trajectories = cast(Table, TrajectoryRow.__table__)
_episodes = cast(Table, Episode.__table__)
_runs = cast(Table, Run.__table__)
_t = _trajectories.c

# Leases past their time back to `ready` (p_run_id, p_now).
EXPIRE: Update = (
    update(_trajectories)
    .where(_t.run_id == bindparam("p_run_id"))
    .where(_t.status == "leased")
    .where(_t.lease_until < bindparam("p_now"))
    .values(status="ready", lease_until=None)
)

# The run's weight version (p_run_id).
VERSION: Select = select(_runs.c.weight_version).where(_runs.c.id == bindparam("p_run_id"))

# Lease the chosen rows still `ready` (p_ids, p_lease_id, p_until).
LEASE: ByDialect[Update] = both(
    lambda array: (
        update(_trajectories)
        .where(id_match(_t.id, "p_ids", array=array))
        .where(_t.status == "ready")
        .values(status="leased", lease_id=bindparam("p_lease_id"), lease_until=bindparam("p_until"))
    )
)

# The ids a lease still holds, in serving order (p_run_id, p_lease_id); and their renewal
# (p_ids, p_until).
HELD: Select = (
    select(_t.id)
    .where(_t.run_id == bindparam("p_run_id"))
    .where(_t.status == "leased")
    .where(_t.lease_id == bindparam("p_lease_id"))
    .order_by(_t.created_at, _t.id)
)
RENEW: ByDialect[Update] = both(
    lambda array: (
        update(_trajectories)
        .where(id_match(_t.id, "p_ids", array=array))
        .values(lease_until=bindparam("p_until"))
    )
)


def _stale() -> Select:
    """Unserved ready rows past the bound of groups whose episodes have all ended
    (p_run_id, p_bound)."""
    sibling = _episodes.alias("sibling")
    still_playing = (
        select(sibling.c.id)
        .where(sibling.c.run_id == bindparam("p_run_id"))
        .where(sibling.c.group_id == _episodes.c.group_id)
        .where(sibling.c.status.in_(OPEN_EPISODE_STATUSES))
        .exists()
    )
    return (
        select(_t.id, _episodes.c.group_id)
        .join(_episodes, _episodes.c.id == _t.episode_id)
        .where(_t.run_id == bindparam("p_run_id"))
        .where(_t.status == "ready")
        .where(_t.times_served == 0)
        .where(_t.min_weight_version < bindparam("p_bound"))
        .where(~still_playing)
    )


STALE = _stale()
MARK_STALE: ByDialect[Update] = both(
    lambda array: (
        update(_trajectories).where(id_match(_t.id, "p_ids", array=array)).values(status="stale")
    )
)
# How many of a group's trajectories are still to train on (p_group).
GROUP_LEFT: Select = (
    select(func.count())
    .select_from(_trajectories.join(_episodes, _episodes.c.id == _t.episode_id))
    .where(_episodes.c.group_id == bindparam("p_group"))
    .where(_t.status.in_(("ready", "leased", "consumed")))
)


def _candidates(*, fresh: bool, bounded: bool) -> Select:
    """Servable rows of whole groups, group by group in serving order, of at most
    `p_max_n` groups (p_run_id, p_group_size, p_max_n; replays also p_max_served;
    p_bound when `bounded`). A group is whole when none of its episodes is open and it
    has `p_group_size` of them: checked once per group with ready rows (one aggregate),
    not once per row.

    A pull of `max_n` rows takes at most `max_n` groups, each of at most `max_n` rows
    (only the first group in serving order may be larger: a pull that finds nothing else
    splits it, `stream._whole_groups`). So only the first `max_n` of those groups are
    read, and a pull costs the client O(max_n) rows, not the run's whole backlog. Where
    groups differ in size (some trajectories dropped as stale), a pull may come back
    short of `max_n` where a later small group would have filled it; the next pull
    takes that group."""
    ready = (
        select(
            _t.id,
            _episodes.c.group_id,
            _t.times_served,
            _t.created_at,
            _t.lease_id,
            _t.min_weight_version,
        )
        .join(_episodes, _episodes.c.id == _t.episode_id)
        .where(_t.run_id == bindparam("p_run_id"))
        .where(_t.status == "ready")
    )
    if fresh:
        ready = ready.where(_t.times_served == 0)
    else:
        ready = ready.where(_t.times_served.between(1, bindparam("p_max_served")))
    if bounded:  # replays only inside the bound, whatever the policy; fresh ones when dropped
        ready = ready.where(
            or_(_t.min_weight_version.is_(None), _t.min_weight_version >= bindparam("p_bound"))
        )
    rows = ready.cte("ready_rows")
    peer = _episodes.alias("peer")
    whole = (
        select(peer.c.group_id)
        .where(peer.c.group_id.in_(select(rows.c.group_id).where(rows.c.group_id.is_not(None))))
        .group_by(peer.c.group_id)
        .having(func.count() >= bindparam("p_group_size"))
        .having(func.sum(case((peer.c.status.in_(OPEN_EPISODE_STATUSES), 1), else_=0)) == 0)
    )
    order: tuple[Any, ...]
    if fresh:
        # The oldest policy first (then the earliest ended): a group that finishes after
        # younger ones overtook it is the next to age past the bound, so it goes first.
        order = (rows.c.min_weight_version.nulls_last(), rows.c.created_at, rows.c.id)
    else:
        # The least replayed first, then the most recent (closest to the policy).
        order = (rows.c.times_served, rows.c.created_at.desc(), rows.c.id)
    servable = (
        select(rows, func.row_number().over(order_by=order).label("nth_row"))
        .where(or_(rows.c.group_id.is_(None), rows.c.group_id.in_(whole)))
        .subquery("servable")
    )
    s = servable.c
    # A group's place is its first row's; a row without a group is a group of its own.
    group_key = (s.group_id, case((s.group_id.is_(None), s.id)))
    placed = select(
        servable,
        func.min(s.nth_row).over(partition_by=group_key).label("group_place"),
        func.count().over(partition_by=group_key).label("group_rows"),
    ).subquery("placed")
    p = placed.c
    ranked = (
        select(placed, func.dense_rank().over(order_by=p.group_place).label("nth_group"))
        .where(or_(p.group_rows <= bindparam("p_max_n"), p.group_place == 1))
        .subquery("ranked")
    )
    r = ranked.c
    return (
        select(r.id, r.group_id, r.times_served, r.created_at, r.lease_id, r.min_weight_version)
        .where(r.nth_group <= bindparam("p_max_n"))
        .order_by(r.group_place, r.nth_row)
    )


FRESH = _candidates(fresh=True, bounded=False)
FRESH_BOUNDED = _candidates(fresh=True, bounded=True)
REPLAY = _candidates(fresh=False, bounded=False)
REPLAY_BOUNDED = _candidates(fresh=False, bounded=True)


def _ack(*, by_lease: bool, array: bool) -> Update:
    """Count one training of each row of p_ids still leased or ready in the run
    (p_run_id, p_max_reuse; by `p_lease_id` when `by_lease`)."""
    query = (
        update(_trajectories)
        .where(_t.run_id == bindparam("p_run_id"))
        .where(id_match(_t.id, "p_ids", array=array))
        .where(_t.lease_id.is_not(None))
        .where(_t.status.in_(("leased", "ready")))
        .values(
            times_served=_t.times_served + 1,
            status=case(
                (_t.times_served + 1 >= bindparam("p_max_reuse"), "consumed"), else_="ready"
            ),
            lease_id=None,
            lease_until=None,
        )
    )
    return query.where(_t.lease_id == bindparam("p_lease_id")) if by_lease else query


ACK = both(lambda array: _ack(by_lease=False, array=array))
ACK_LEASE = both(lambda array: _ack(by_lease=True, array=array))

# A trainer starting up takes back its predecessor's leases (p_run_id).
RECLAIM: Update = (
    update(_trajectories)
    .where(_t.run_id == bindparam("p_run_id"))
    .where(_t.status == "leased")
    .values(status="ready", lease_until=None)
)
