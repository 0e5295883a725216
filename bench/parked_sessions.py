"""Do episodes waiting on slow envs take decode slots from the others?

Runs `--fast` white-box episodes on a trivial env, on a LocalEngine, first alone and then
beside `--slow` episodes whose env takes `--env-delay` seconds per step (parked after
`--park-after` s). Samples the engine every few ms and prints, for both, the busy ratio
(share of samples with at least one request decoding) and the mean decode batch while
busy. Equal batches mean the waiting sessions hold no slot.

    python bench/parked_sessions.py [--fast 16] [--slow 50] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from scripted_env import DelayEnv  # bench/ is on sys.path when run as a script

from agentflow.agents.base import Budget, EpisodeHandle
from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db import migrate
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.inference.base import SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit
from agentflow.tokenization.chat import ByteChatTemplate


async def measure(args: argparse.Namespace, url: str, slow: int) -> dict[str, float]:
    db = create_engine(url)
    turns = TurnTree(session_factory(db))
    engine = LocalEngine.from_init(
        ModelInit(layers=2, hidden=128, heads=4, max_context=2048), max_batch_size=args.fast
    )
    runtime = PolicyRuntime(
        engine, ByteChatTemplate(), sampling=SamplingParams(max_new_tokens=32), max_context=2048
    )
    agent = WhiteBoxAgent(park_after_s=args.park_after)
    stop = asyncio.Event()

    async def loop(delay: float) -> None:
        while not stop.is_set():
            episode_id = await turns.create_episode(env_ref="bench")
            handle = EpisodeHandle(
                episode_id=episode_id,
                run_id=None,
                env=DelayEnv(delay, steps=4),
                runtime=runtime,
                turns=turns,
                budget=Budget(max_turns=4, max_tokens=2000),
            )
            await agent.run(handle)

    workers = [asyncio.create_task(loop(args.env_delay)) for _ in range(slow)]
    workers += [asyncio.create_task(loop(0.0)) for _ in range(args.fast)]
    samples: list[int] = []
    await asyncio.sleep(2.0)  # warm up: every episode under way
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        samples.append((await engine.info()).running)
        await asyncio.sleep(0.005)
    stop.set()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    await engine.close()
    await db.dispose()
    busy = [s for s in samples if s > 0]
    return {
        "busy": len(busy) / max(1, len(samples)),
        "batch": statistics.mean(busy) if busy else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", type=int, default=16)
    parser.add_argument("--slow", type=int, default=50)
    parser.add_argument("--env-delay", type=float, default=3.0)
    parser.add_argument("--park-after", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        migrate.upgrade(url)
        alone = asyncio.run(measure(args, url, slow=0))
        beside = asyncio.run(measure(args, url, slow=args.slow))
    print(f"{args.fast} fast episodes, engine max batch {args.fast}:")
    print(f"  alone:               busy {alone['busy']:.1%}  mean batch {alone['batch']:.2f}")
    print(
        f"  beside {args.slow} waiting:   busy {beside['busy']:.1%}  "
        f"mean batch {beside['batch']:.2f}  (ratio {beside['batch'] / alone['batch']:.2f})"
    )


if __name__ == "__main__":
    main()
