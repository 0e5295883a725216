"""The controller's CPU per trajectory lease: `DbTrajectoryStream.pull` and `ack` on
PostgreSQL, as a trainer drives them.

A trainer pulls each time trajectories are added, so at a thousand live episodes the
gateway runs about twenty lease transactions a second; their CPU is the controller's.
This writes `--groups` finished groups of `--group-size` episodes into a scratch database,
then leases them one group at a time (`pull(group_size)`, then `ack`) until none is left,
and prints the median process CPU of a pull and of an ack over `--repeat` rounds.

`--against DIR` measures another checkout of the project as well (its code on
`PYTHONPATH`, in a child process, alternating with this one) and prints the ratios.

    python bench/lease_cpu.py [--groups 60] [--group-size 8] [--repeat 3]
                              [--database-url URL] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, only bench/ is on sys.path: `tests` imports from the root, after
# PYTHONPATH, so a child measuring another checkout (`--against`) imports that one's code.
ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database  # noqa: E402


async def _measure(url: str, groups: int, group_size: int) -> dict[str, float]:
    from agentflow.db.session import create_engine, session_factory
    from agentflow.db.turn_tree import TurnTree
    from agentflow.rollout.stream import DbTrajectoryStream
    from tests.integration.rollout.stream_fixtures import finished_group, make_run

    engine = create_engine(url)
    try:
        turns = TurnTree(session_factory(engine))
        run_id = await make_run(turns, group_size=group_size)
        for _ in range(groups):
            await finished_group(turns, run_id, group_size)
        stream = DbTrajectoryStream(turns, run_id, group_size=group_size, max_staleness=4)
        pulls: list[float] = []
        acks: list[float] = []
        while True:
            started = time.process_time()
            got = await stream.pull(group_size)
            pulled = time.process_time()
            if not got:
                break
            await stream.ack([t.id for t in got], got[0].lease_id)
            pulls.append(pulled - started)
            acks.append(time.process_time() - pulled)
        if len(pulls) != groups:
            raise RuntimeError(f"leased {len(pulls)} groups of {groups}")
        warm = max(1, groups // 10)  # the first leases prepare the statements
        return {
            "pull_ms": 1000 * statistics.median(pulls[warm:]),
            "ack_ms": 1000 * statistics.median(acks[warm:]),
        }
    finally:
        await engine.dispose()


def _one(args: argparse.Namespace) -> dict[str, float]:
    import uvloop

    with scratch_database(args.database_url, prefix="agentflow_lease_cpu") as url:
        return uvloop.run(_measure(url, args.groups, args.group_size))


def _child(args: argparse.Namespace, checkout: Path) -> dict[str, float]:
    """One round with `checkout`'s code (this file runs there with `--json`)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--json",
        f"--groups={args.groups}",
        f"--group-size={args.group_size}",
        f"--database-url={args.database_url}",
    ]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, check=True, timeout=600
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=60)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each a fresh database)")
    parser.add_argument("--database-url", default=DEFAULT_ADMIN_URL, help="maintenance database")
    parser.add_argument("--against", type=Path, default=None, help="another checkout")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:  # one round, for a parent comparing checkouts
        print(json.dumps(_one(args)))
        return
    sides = {"this checkout": lambda: _child(args, ROOT)}
    if args.against is not None:
        sides = {"against": lambda: _child(args, args.against.resolve()), **sides}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.repeat):
        for name, run in sides.items():  # alternating, so both see the same machine
            rounds[name].append(run())
    print(
        f"{args.groups} groups of {args.group_size}, leased one group a pull, "
        f"median of {args.repeat} rounds (process CPU per call)"
    )
    print("| code | pull ms | ack ms |\n|---|---|---|")
    medians = {}
    for name, results in rounds.items():
        pull = statistics.median(r["pull_ms"] for r in results)
        ack = statistics.median(r["ack_ms"] for r in results)
        medians[name] = (pull, ack)
        print(f"| {name} | {pull:.2f} | {ack:.2f} |")
    if args.against is not None:
        (old_pull, old_ack), (new_pull, new_ack) = medians["against"], medians["this checkout"]
        print(
            f"ratio (against / this): pull x{old_pull / new_pull:.2f}, ack x{old_ack / new_ack:.2f}"
        )


if __name__ == "__main__":
    main()
