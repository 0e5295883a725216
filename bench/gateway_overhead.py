"""What the gateway adds per turn: the white-box loop with persistence on PostgreSQL,
against calling the same engine and env directly, in one run.

The engine answers instantly (a fixed reply, no model) and the env is trivial, so the
difference is the gateway's own cost: chat-template deltas, bookkeeping, and writing
every turn to the database. Prints p50/p99 per-turn latency of both at concurrency 1,
the added time, and turns/s of the gateway with many episodes at once.

    python bench/gateway_overhead.py [--turns 20] [--episodes 200] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from scripted_env import DelayEnv  # bench/ is on sys.path when run as a script

from agentflow.agents.base import Budget, EpisodeHandle
from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef
from agentflow.tokenization.chat import ByteChatTemplate
from envs.base import TextAction

# Run as a script, only bench/ is on sys.path: `tests` imports from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.engine import MockEngine  # noqa: E402
from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database  # noqa: E402

TEMPLATE = ByteChatTemplate()
REPLY = TEMPLATE.tokenizer.encode("guess 8") + [TEMPLATE.tokenizer.end_id]


def instant_engine() -> MockEngine:
    """Answers every request at once with the same short reply (no model)."""
    return MockEngine(lambda request, engine: REPLY, logprob=-0.5, max_context=1 << 20)


async def direct_episode(engine: MockEngine, turns: int) -> list[float]:
    """The same work without the gateway: engine and env called in a bare loop."""
    env = DelayEnv(0.0, turns)
    first = await env.reset()
    pending = TEMPLATE.render([m.model_dump() for m in first.observation.messages]).token_ids
    session = await engine.open_session()
    parent, per_turn = None, []
    for _ in range(turns):
        start = time.perf_counter()
        req = GenerateRequest(
            input_ids=tuple(pending),
            sampling=SamplingParams(max_new_tokens=16),
            session=SessionRef(session_id=session, parent_rid=parent),
        )
        result = await engine.generate(req)
        parent = req.rid
        step = await env.step(TextAction(text="guess 8"))
        pending = TEMPLATE.render_delta(
            [m.model_dump() for m in step.observation.messages], after=result.output_ids
        ).token_ids
        per_turn.append(time.perf_counter() - start)
    return per_turn


async def gateway_episode(turns_store: TurnTree, runtime: PolicyRuntime, turns: int) -> float:
    episode_id = await turns_store.create_episode(env_ref="bench/trivial-v0")
    handle = EpisodeHandle(
        episode_id=episode_id,
        run_id=None,
        env=DelayEnv(0.0, turns),
        runtime=runtime,
        turns=turns_store,
        budget=Budget(max_turns=turns, max_tokens=1 << 20),
    )
    start = time.perf_counter()
    outcome = await WhiteBoxAgent(park_after_s=None).run(handle)
    elapsed = time.perf_counter() - start
    assert outcome.status == "completed", outcome
    await turns_store.complete_episode(episode_id, "completed", outcome.reward)
    return elapsed / turns


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def bench(url: str, args: argparse.Namespace) -> None:
    db = create_engine(url)
    store = TurnTree(session_factory(db))
    engine = instant_engine()
    runtime = PolicyRuntime(engine, TEMPLATE, sampling=SamplingParams(max_new_tokens=16))

    direct: list[float] = []
    gateway: list[float] = []
    for _ in range(args.latency_episodes):  # interleaved so load drifts hit both alike
        direct += await direct_episode(engine, args.turns)
        gateway.append(await gateway_episode(store, runtime, args.turns))
    d50, g50 = statistics.median(direct), statistics.median(gateway)
    print(f"per-turn latency at concurrency 1 ({args.latency_episodes} episodes x {args.turns}):")
    print(f"  direct engine+env   p50 {d50 * 1e3:7.3f} ms   p99 {_pct(direct, 99) * 1e3:7.3f} ms")
    print(f"  through the gateway p50 {g50 * 1e3:7.3f} ms   p99 {_pct(gateway, 99) * 1e3:7.3f} ms")
    print(f"  added by the gateway p50 {(g50 - d50) * 1e3:.3f} ms per turn (target <= 2 ms)")

    semaphore = asyncio.Semaphore(args.concurrency)

    async def one() -> None:
        async with semaphore:
            await gateway_episode(store, runtime, args.turns)

    async def one_direct() -> None:
        async with semaphore:
            await direct_episode(engine, args.turns)

    total = args.episodes * args.turns
    start = time.perf_counter()
    await asyncio.gather(*(one_direct() for _ in range(args.episodes)))
    direct_rate = total / (time.perf_counter() - start)
    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(args.episodes)))
    rate = total / (time.perf_counter() - start)
    print(f"throughput ({args.episodes} episodes x {args.turns} turns, {args.concurrency} live):")
    print(f"  direct  {direct_rate:10.0f} turns/s")
    print(f"  gateway {rate:10.0f} turns/s  (target >= 1000; {rate / direct_rate:.3f}x direct)")
    await db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--latency-episodes", type=int, default=30)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--pg-url", default=DEFAULT_ADMIN_URL)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; PostgreSQL")
    with scratch_database(args.pg_url, prefix="agentflow_bench") as url:
        asyncio.run(bench(url, args))


if __name__ == "__main__":
    main()
