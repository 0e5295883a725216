"""Reading a lease's trajectories as the turns table grows: the recursive path query
against reading each leaf's episode by its index and linking the path in Python.

A trainer's lease reads the root-first path of every trajectory it takes (a few hundred
at once). The recursive query walks parent links; its plan moves with the table's
statistics: a hash join over a scan of the whole turns table (its cost grows with every
turn the run has ever written), or a nested loop of index probes, and both are costed
high enough to be JIT-compiled on every run. The episode read (`turn_sql.episode_paths`)
takes the same rows by the index on `turns.episode_id` and links each path in Python.

This fills a scratch PostgreSQL database in steps up to `--episodes` finished episodes
(a prompt, then policy and env turns: `--turns` per episode), and at each size reads the
paths of `--leaves` trajectories both ways, alternating, `--repeat` times; it checks the
two give the same paths and prints the median wall time of each and the ratio.

    python bench/trajectory_paths.py [--episodes 2000,20000,60000] [--turns 9]
                                     [--leaves 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentflow.db.turn_tree import TurnTree

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database  # noqa: E402

_BATCH = 250  # episodes written per round of group commits


async def _fill(turns: TurnTree, run_id: uuid.UUID, episodes: int, depth: int) -> list[uuid.UUID]:
    """`episodes` finished episodes of `depth` turns each; their leaves."""
    from agentflow.types import NewTurn, TurnRecord

    rng = random.Random(episodes)
    leaves: list[uuid.UUID] = []
    for start in range(0, episodes, _BATCH):
        n = min(_BATCH, episodes - start)
        ids = await asyncio.gather(
            *(turns.create_episode(run_id=run_id, env_ref="bench/x") for _ in range(n))
        )
        parents: dict[uuid.UUID, uuid.UUID] = {}
        for level in range(depth):
            batch = []
            for episode in ids:
                if level == 0:
                    record = TurnRecord(kind="prompt", token_ids=tuple(range(1, 41)))
                elif level % 2:
                    tokens = tuple(rng.randrange(256) for _ in range(48))
                    record = TurnRecord(
                        kind="policy",
                        token_ids=tokens,
                        logprobs=tuple(-rng.random() for _ in tokens),
                        weight_versions=(0,) * len(tokens),
                    )
                else:
                    record = TurnRecord(kind="env", token_ids=tuple(range(12)), reward=0.0)
                turn = NewTurn(episode_id=episode, parent_id=parents.get(episode), record=record)
                parents[episode] = turn.id
                batch.append(turn)
            await turns.add_turns(batch)
        await asyncio.gather(*(turns.complete_episode(e, "completed", 1.0) for e in ids))
        leaves += [parents[e] for e in ids]
    return leaves


async def _time_reads(
    turns: TurnTree, leaves: list[uuid.UUID], n_leaves: int, repeat: int
) -> dict[str, list[float]]:
    """Wall time of `repeat` reads of `n_leaves` paths each way, alternating; the two
    must find the same paths."""
    from sqlalchemy import select

    from agentflow.db import turn_sql

    times: dict[str, list[float]] = {"recursive": [], "episode": []}
    columns = turn_sql.TRAJECTORY_COLUMNS
    for round_ in range(repeat):
        chosen = leaves[round_ * n_leaves : (round_ + 1) * n_leaves] or leaves[:n_leaves]
        async with turns.sessions() as session:
            query = select(turn_sql.turns.c.id, turn_sql.turns.c.episode_id)
            rows = await session.execute(query.where(turn_sql.turns.c.id.in_(chosen)))
            of_episode = {row.id: row.episode_id for row in rows}
            started = time.perf_counter()
            old = await turn_sql.paths(session, chosen, columns)
            times["recursive"].append(time.perf_counter() - started)
            started = time.perf_counter()
            new = await turn_sql.episode_paths(session, of_episode, columns)
            times["episode"].append(time.perf_counter() - started)
        for leaf in chosen:
            if [r.id for r in old[leaf]] != [r.id for r in new[leaf]]:
                raise AssertionError(f"the two reads differ on leaf {leaf}")
    return times


async def _measure(url: str, sizes: list[int], depth: int, n_leaves: int, repeat: int) -> None:
    from sqlalchemy import text

    from agentflow.db.session import create_engine, session_factory
    from agentflow.db.turn_tree import TurnTree
    from tests.integration.rollout.stream_fixtures import make_run

    engine = create_engine(url)
    try:
        turns = TurnTree(session_factory(engine))
        run_id = await make_run(turns)
        leaves: list[uuid.UUID] = []
        print(f"leaves per read {n_leaves}, turns per episode {depth}, median of {repeat}")
        print("| episodes | turns | statistics | recursive query ms | episode read ms | ratio |")
        print("|---|---|---|---|---|---|")
        rng = random.Random(0)
        for size in sizes:
            leaves += await _fill(turns, run_id, size - len(leaves), depth)
            # First as written (a young run: autovacuum may not have analyzed the table
            # yet), then with fresh statistics, as a run that has gone on for a while.
            for stats in ("as written", "analyzed"):
                if stats == "analyzed":
                    async with turns.sessions() as session:
                        await session.execute(text("ANALYZE turns"))
                        await session.commit()
                times = await _time_reads(turns, rng.sample(leaves, len(leaves)), n_leaves, repeat)
                recursive = 1000 * statistics.median(times["recursive"])
                by_episode = 1000 * statistics.median(times["episode"])
                print(
                    f"| {size:,} | {size * depth:,} | {stats} | {recursive:.1f} "
                    f"| {by_episode:.1f} | x{recursive / by_episode:.1f} |",
                    flush=True,
                )
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", default="2000,20000,60000", help="sizes, ascending")
    parser.add_argument("--turns", type=int, default=9, help="turns per episode")
    parser.add_argument("--leaves", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", default=DEFAULT_ADMIN_URL, help="maintenance database")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.episodes.split(","))
    import uvloop

    with scratch_database(args.database_url, prefix="agentflow_bench_paths") as url:
        uvloop.run(_measure(url, sizes, args.turns, args.leaves, args.repeat))


if __name__ == "__main__":
    main()
