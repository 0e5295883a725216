"""Turn-store throughput: write branching turn trees, then rebuild every turn's context.

Runs on PostgreSQL (a scratch database made on the local server and dropped afterwards)
and on SQLite (a temporary file), and compares, in the same run:

- batched   `TurnTree.add_turns`, one transaction and one executemany per batch (the
            store's write path): the whole 10,000-turn workload from one task, again
            from 4 concurrent writer tasks, and in one-episode batches of 20;
- single    `TurnTree.add_turn` from 64 concurrent tasks, each awaiting its turn before
            the next, as rollouts call it (concurrent calls are group-committed);
- naive     one ORM row per INSERT + COMMIT, one at a time (the baseline).

Reads: `TurnTree.contexts` over every written turn (100 ids per call, one recursive
query each) and `TurnTree.context` one turn at a time; every context is checked against
the tokens written.

Usage: python bench/turn_store.py [--episodes 500] [--pg-url postgresql+asyncpg://...]
Target: >= 2,000 turns/s written on PostgreSQL from one process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.db import migrate
from agentflow.db.models import Turn
from agentflow.db.packing import pack_floats, pack_ints, pack_mask
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.types import NewTurn, TurnRecord

# Run as a script, only bench/ is on sys.path: `tests` imports from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.scratch_db import scratch_database  # noqa: E402

TURNS_PER_EPISODE = 20  # a 17-turn main line plus a 3-turn branch from a random turn
MAIN_LINE = 17
VOCAB = 150_000


@dataclass(frozen=True)
class Rate:
    label: str
    count: int
    seconds: float
    cpu_seconds: float  # this process only; the database server runs on the same cores

    @property
    def per_s(self) -> float:
        return self.count / self.seconds

    def line(self, unit: str, baseline: Rate | None = None) -> str:
        ratio = f"  {self.per_s / baseline.per_s:5.1f}x naive" if baseline else ""
        return (
            f"  {self.label:<38} {self.count:>6} {unit} in {self.seconds:6.2f} s "
            f"= {self.per_s:6.0f} {unit}/s (client CPU {1e3 * self.cpu_seconds / self.count:.2f}"
            f" ms each){ratio}"
        )


def _record(rng: random.Random, kind: str, version: int) -> TurnRecord:
    n = rng.randint(150, 250)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    if kind != "policy":
        return TurnRecord(kind=kind, token_ids=tokens, text="observation")  # type: ignore[arg-type]
    return TurnRecord(
        kind="policy",
        token_ids=tokens,
        logprobs=[-rng.random() * 5 for _ in range(n)],
        weight_versions=[version] * n,
        finish_reason="stop",
        timings={"queue": 0.01, "generate": 0.5},
    )


def workload(rng: random.Random, episodes: Sequence[uuid.UUID]) -> list[NewTurn]:
    """Branching trees, parents first: prompt, then policy/env alternating; each episode
    also re-rolls a 3-turn branch from a random turn of its main line."""
    turns: list[NewTurn] = []
    for episode in episodes:
        main: list[NewTurn] = []
        for depth in range(MAIN_LINE):
            kind = "prompt" if depth == 0 else ("policy" if depth % 2 else "env")
            parent = main[-1].id if main else None
            main.append(
                NewTurn(
                    episode_id=episode,
                    parent_id=parent,
                    record=_record(rng, kind, version=depth // 4),
                )
            )
        turns.extend(main)
        fork = main[rng.randrange(1, MAIN_LINE - 1)]
        parent_id = fork.id
        kind = fork.record.kind
        for _ in range(TURNS_PER_EPISODE - MAIN_LINE):
            kind = "env" if kind == "policy" else "policy"
            turn = NewTurn(
                episode_id=episode, parent_id=parent_id, record=_record(rng, kind, version=9)
            )
            turns.append(turn)
            parent_id = turn.id
    return turns


async def _timed(label: str, count: int, job: Awaitable[object]) -> Rate:
    start, cpu = time.perf_counter(), time.process_time()
    await job
    return Rate(label, count, time.perf_counter() - start, time.process_time() - cpu)


async def _episodes(tree: TurnTree, n: int) -> list[uuid.UUID]:
    return [await tree.create_episode(task={"bench": i}) for i in range(n)]


async def write_batches(tree: TurnTree, turns: Sequence[NewTurn], size: int, writers: int) -> None:
    """`writers` tasks, each writing whole episodes in batches of `size` turns."""

    async def writer(part: Sequence[NewTurn]) -> None:
        for start in range(0, len(part), size):
            await tree.add_turns(part[start : start + size])

    await asyncio.gather(*(writer(part) for part in _episode_lanes(turns, writers)))


async def write_singles(tree: TurnTree, turns: Sequence[NewTurn], tasks: int) -> None:
    """`tasks` concurrent tasks, each adding its episodes' turns one call at a time."""

    async def lane(part: Sequence[NewTurn]) -> None:
        for t in part:
            await tree.add_turn(t.episode_id, t.parent_id, t.record, turn_id=t.id)

    await asyncio.gather(*(lane(part) for part in _episode_lanes(turns, tasks)))


async def write_naive(sessions: async_sessionmaker[AsyncSession], turns: Sequence[NewTurn]) -> None:
    """The baseline: one ORM object, one INSERT, one COMMIT per turn."""
    depth: dict[uuid.UUID, int] = {}
    for t in turns:
        depth[t.id] = 0 if t.parent_id is None else depth[t.parent_id] + 1
        r = t.record
        async with sessions() as session:
            session.add(
                Turn(
                    id=t.id,
                    episode_id=t.episode_id,
                    parent_id=t.parent_id,
                    depth=depth[t.id],
                    kind=r.kind,
                    token_ids=pack_ints(r.token_ids),
                    logprobs=None if r.logprobs is None else pack_floats(r.logprobs),
                    weight_versions=(
                        None if r.weight_versions is None else pack_ints(r.weight_versions)
                    ),
                    loss_mask=pack_mask(r.loss_mask or ()),
                    text=r.text,
                    reward=r.reward,
                    finish_reason=r.finish_reason,
                    timings=dict(r.timings),
                )
            )
            await session.commit()


async def read_contexts(
    tree: TurnTree, turns: Sequence[NewTurn], per_call: int, by_id: dict[uuid.UUID, NewTurn]
) -> int:
    """Rebuild the context of each of `turns`, checking it against the workload (`by_id`
    holds every written turn); the total number of context tokens."""
    tokens = 0
    for start in range(0, len(turns), per_call):
        part = turns[start : start + per_call]
        if per_call == 1:
            contexts = [await tree.context(part[0].id)]
        else:
            contexts = await tree.contexts([t.id for t in part])
        for turn, context in zip(part, contexts, strict=True):
            expected: list[int] = []
            node: NewTurn | None = turn
            while node is not None:
                expected[:0] = node.record.token_ids
                node = by_id.get(node.parent_id) if node.parent_id else None
            assert list(context.token_ids) == expected, "a context did not round-trip"
            tokens += len(context.token_ids)
    return tokens


async def bench_database(url: str, episodes: int, naive_turns: int, seed: int) -> None:
    engine = create_engine(url)
    sessions = session_factory(engine)
    tree = TurnTree(sessions)
    rng = random.Random(seed)
    small = max(1, episodes // 5)
    try:
        turns = workload(rng, await _episodes(tree, episodes))
        more = workload(rng, await _episodes(tree, episodes))
        per_episode = workload(rng, await _episodes(tree, small))
        singles = workload(rng, await _episodes(tree, small))
        naive = workload(rng, await _episodes(tree, max(1, naive_turns // TURNS_PER_EPISODE)))
        writes = [
            await _timed("add_turns, 200/batch", len(turns), write_batches(tree, turns, 200, 1)),
            await _timed(
                "add_turns, 200/batch, 4 writers", len(more), write_batches(tree, more, 200, 4)
            ),
            await _timed(
                "add_turns, 20/batch (1 episode)",
                len(per_episode),
                write_batches(tree, per_episode, TURNS_PER_EPISODE, 1),
            ),
            await _timed(
                "add_turn, 64 concurrent tasks", len(singles), write_singles(tree, singles, 64)
            ),
        ]
        base = await _timed("naive ORM, 1 row per commit", len(naive), write_naive(sessions, naive))
        print("  writes:")
        for rate in writes:
            print(rate.line("turns", base))
        print(base.line("turns"))

        start, cpu = time.perf_counter(), time.process_time()
        by_id = {t.id: t for t in turns}
        tokens = await read_contexts(tree, turns, 100, by_id)
        read = Rate(
            "contexts, 100 per call",
            len(turns),
            time.perf_counter() - start,
            time.process_time() - cpu,
        )
        sample = turns[:: max(1, len(turns) // 1000)]
        read_one = await _timed(
            "context, one per call", len(sample), read_contexts(tree, sample, 1, by_id)
        )
        print(f"  reads (every turn's context, checked; mean {tokens / len(turns):.0f} tokens):")
        print(read.line("contexts"))
        print(read_one.line("contexts"))
        print(f"  {tokens / read.seconds / 1e6:.2f} M context tokens/s rebuilt")
    finally:
        await engine.dispose()


def _episode_lanes(turns: Sequence[NewTurn], n: int) -> list[list[NewTurn]]:
    """Split whole episodes round-robin over `n` lanes, keeping each episode's order."""
    lanes: list[list[NewTurn]] = [[] for _ in range(n)]
    order: dict[uuid.UUID, int] = {}
    for t in turns:
        lane = order.setdefault(t.episode_id, len(order) % n)
        lanes[lane].append(t)
    return lanes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=500, help="20 turns each")
    parser.add_argument("--naive-turns", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pg-url",
        default="postgresql+asyncpg://postgres@127.0.0.1:5432/test",
        help="maintenance database; a scratch database is made beside it",
    )
    parser.add_argument("--skip-pg", action="store_true")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    if not args.skip_pg:
        with scratch_database(args.pg_url, prefix="agentflow_bench") as url:
            print(f"PostgreSQL ({args.episodes} episodes x {TURNS_PER_EPISODE} turns):")
            asyncio.run(bench_database(url, args.episodes, args.naive_turns, args.seed))

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        migrate.upgrade(url)
        print(f"SQLite ({args.episodes} episodes x {TURNS_PER_EPISODE} turns):")
        asyncio.run(bench_database(url, args.episodes, args.naive_turns, args.seed))


if __name__ == "__main__":
    main()
