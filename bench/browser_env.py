"""Browser env latency: the warm pool against a cold launch per episode, in one run.

Both paths play the same MiniWoB++ episodes (the scripted oracle, the same seeds) with
the same env code; they differ only in where the browser comes from:

- warm: one `BrowserPool` for the whole run, each task's page recycled from one
  episode to the next (as MiniWoB++ itself runs them): AgentFlow's default; the pool is
  warmed by the same load at the same concurrency before the clock starts;
- fresh: the same pool, but a new context with the page loaded for every episode
  (prepared ahead), `recycle_pages = false`;
- cold: a new browser per episode, launched by one Playwright driver kept for the
  whole run, as BrowserGym does (its reset closes the browser and launches another from
  a global driver).

Both launch the same executable (envs/browser/chromium.py: the headless shell where it
is installed).

No artificial delay is added anywhere (BrowserGym adds a 0.5 s pre-observation delay
and 100 ms slow-mo per action). Prints reset and step latency (p50/p90) and episodes/s
for each path, the contexts each made while the clock ran, and the ratios; one run per
concurrency given. Targets: warm reset p50 <= 0.3 s, step p50 <= 0.15 s, warm
episodes/s >= 5x cold. docs/computer-use.md has the numbers.

    python bench/browser_env.py --episodes 200 --cold-episodes 30 --concurrency 1 4 8
    python bench/browser_env.py ... --no-screenshots    # as examples/miniwob.toml trains
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs import registry  # noqa: E402
from envs.browser.miniwob import make_env  # noqa: E402
from envs.browser.pool import BrowserPool  # noqa: E402

TASKS = ("click-button", "click-link", "click-option", "enter-text", "click-checkboxes")


@dataclass
class Timings:
    resets: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0
    prepared: int = 0  # contexts made (a page load each) while the clock ran


async def episode(
    task: str, seed: int, pool: BrowserPool, timings: Timings, *, recycle: bool, shots: bool
) -> None:
    env = make_env(task, pool=pool, screenshots=shots, recycle_pages=recycle)
    oracle = registry.oracle(f"miniwob/{task}-v0")
    try:
        started = time.perf_counter()
        result = await env.reset(seed=seed)
        timings.resets.append(time.perf_counter() - started)
        observations = [result.observation]
        for _ in range(10):
            if result.done:
                break
            started = time.perf_counter()
            result = await env.step(oracle(observations))
            timings.steps.append(time.perf_counter() - started)
            observations.append(result.observation)
        timings.rewards.append(result.reward)
    finally:
        await env.close()


async def warm(episodes: int, concurrency: int, *, recycle: bool, shots: bool) -> Timings:
    timings = Timings()
    pool = BrowserPool(size=1 if concurrency == 1 else 2)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, into: Timings) -> None:
        async with gate:
            await episode(TASKS[i % len(TASKS)], i, pool, into, recycle=recycle, shots=shots)

    # The pool's browsers and the contexts this load keeps (each task's pages to recycle
    # and its spares) are made before the clock starts, by the same load at the same
    # concurrency: a gateway keeps them warm between episodes.
    warmup = len(TASKS) * concurrency
    await asyncio.gather(*(one(10_000 + i, Timings()) for i in range(warmup)))
    await asyncio.sleep(1.0)
    prepared = pool.prepared
    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, timings) for i in range(episodes)))
    finally:
        timings.seconds = time.perf_counter() - started
        timings.prepared = pool.prepared - prepared
        await pool.aclose()
    return timings


async def cold(episodes: int, concurrency: int, *, shots: bool) -> Timings:
    from playwright.async_api import async_playwright

    timings = Timings()
    gate = asyncio.Semaphore(concurrency)
    driver = await async_playwright().start()

    async def one(i: int) -> None:
        async with gate:
            pool = BrowserPool(size=1, spares=0, idle_close_s=None, playwright=driver)
            try:
                await episode(TASKS[i % len(TASKS)], i, pool, timings, recycle=False, shots=shots)
            finally:
                timings.prepared += pool.prepared
                await pool.aclose()

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(episodes)))
    finally:
        timings.seconds = time.perf_counter() - started
        await driver.stop()
    return timings


def _q(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


def report(name: str, t: Timings, episodes: int) -> float:
    rate = episodes / t.seconds
    print(
        f"{name:5s} reset p50 {statistics.median(t.resets):.3f} s p90 {_q(t.resets, 0.9):.3f} s"
        f" | step p50 {statistics.median(t.steps):.3f} s p90 {_q(t.steps, 0.9):.3f} s"
        f" | {rate:.2f} episodes/s | success {sum(t.rewards) / len(t.rewards):.2f}"
        f" | contexts made {t.prepared}"
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=40, help="per warm/fresh run")
    parser.add_argument("--cold-episodes", type=int, default=10)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1],
        help="episodes at once (several: one run each)",
    )
    parser.add_argument(
        "--screenshots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a PNG screenshot in each observation (the examples/miniwob.toml agent reads text)",
    )
    args = parser.parse_args()
    shots = args.screenshots
    rows = []
    for concurrency in args.concurrency:
        warm_t = asyncio.run(warm(args.episodes, concurrency, recycle=True, shots=shots))
        fresh_t = asyncio.run(warm(args.episodes, concurrency, recycle=False, shots=shots))
        cold_t = asyncio.run(cold(args.cold_episodes, concurrency, shots=shots))
        print(
            f"MiniWoB++ {', '.join(TASKS)}; concurrency {concurrency};"
            f" screenshots {'on' if shots else 'off'}"
        )
        warm_rate = report("warm", warm_t, args.episodes)
        fresh_rate = report("fresh", fresh_t, args.episodes)
        cold_rate = report("cold", cold_t, args.cold_episodes)
        for name, t, rate in (("warm", warm_t, warm_rate), ("fresh", fresh_t, fresh_rate)):
            reset_ratio = statistics.median(cold_t.resets) / statistics.median(t.resets)
            print(
                f"ratio {name}/cold: reset p50 {reset_ratio:.1f}x faster"
                f", episodes/s {rate / cold_rate:.1f}x"
            )
        rows.append((concurrency, warm_rate, fresh_rate, cold_rate))
    if len(rows) > 1:
        print("concurrency | warm eps/s | fresh eps/s | cold eps/s | warm/cold")
        for concurrency, warm_rate, fresh_rate, cold_rate in rows:
            print(
                f"{concurrency:11d} | {warm_rate:10.2f} | {fresh_rate:11.2f} | {cold_rate:10.2f}"
                f" | {warm_rate / cold_rate:8.1f}x"
            )


if __name__ == "__main__":
    main()
