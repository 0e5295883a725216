"""The dashboard's episodes page for a run of 10,000 episodes: how long its first page
takes to load, in Chromium against `agentflow serve`, on SQLite and PostgreSQL.

The database holds the measured run's episodes (three turns each) and two other runs of
the same size. Each database is measured twice in this one script: first without the
episode indexes a run's pages read by (`ix_episodes_run_id` and
`ix_episodes_run_id_created_at` dropped: the baseline), then with them (as migrated).
"Page" is a fresh navigation to `/ui#/runs/<id>/episodes` until its 50 rows are shown;
"API" is the page's own JSON call alone. Prints medians and the ratios.

    python bench/dashboard_episodes.py [--episodes 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from playwright.async_api import async_playwright
from sqlalchemy import insert, text, update

from agentflow.db import migrate
from agentflow.db.models import Episode, Run, Turn
from agentflow.db.packing import pack_floats, pack_ints, pack_mask
from agentflow.db.session import create_engine

# Run as a script, only bench/ is on sys.path: `tests` and `envs` import from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from envs.browser.chromium import chromium_executable  # noqa: E402
from tests.integration.test_gateway_crash import gateway_process  # noqa: E402
from tests.integration.test_serve import _free_port  # noqa: E402
from tests.support.scratch_db import scratch_database  # noqa: E402

KEY = "bench-key"
RUN_INDEXES = ("ix_episodes_run_id", "ix_episodes_run_id_created_at")
CHUNK = 2000


async def seed(url: str, episodes: int, runs: int = 3) -> uuid.UUID:
    """`runs` runs of `episodes` finished episodes each; returns the first run's id."""
    engine = create_engine(url)
    started = datetime.now(UTC) - timedelta(days=1)
    run_ids = [uuid.uuid4() for _ in range(runs)]
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(Run),
                [
                    {"id": r, "name": f"bench-{i}", "config": {}, "status": "stopped"}
                    for i, r in enumerate(run_ids)
                ],
            )
        for index, run_id in enumerate(run_ids):
            for first in range(0, episodes, CHUNK):
                ids = [uuid.uuid4() for _ in range(min(CHUNK, episodes - first))]
                rows = [
                    {
                        "id": e,
                        "run_id": run_id,
                        "env_ref": "agentflow/vault-v0" if n % 3 else "agentflow/count-v0",
                        "task": {"seed": n},
                        "status": "running",
                        "created_at": started + timedelta(seconds=first + n, microseconds=index),
                    }
                    for n, e in enumerate(ids)
                ]
                turns = []
                for n, e in enumerate(ids):
                    prompt, policy = uuid.uuid4(), uuid.uuid4()
                    version = (first + n) // 500
                    for depth, (turn, parent, kind) in enumerate(
                        (
                            (prompt, None, "prompt"),
                            (policy, prompt, "policy"),
                            (None, policy, "env"),
                        )
                    ):
                        sampled = kind == "policy"
                        turns.append(
                            {
                                "id": turn or uuid.uuid4(),
                                "episode_id": e,
                                "parent_id": parent,
                                "depth": depth,
                                "kind": kind,
                                "token_ids": pack_ints(range(40)),
                                "logprobs": pack_floats([-0.5] * 40) if sampled else None,
                                "weight_versions": pack_ints([version] * 40) if sampled else None,
                                "loss_mask": pack_mask([int(sampled)] * 40),
                                "text": "x" * 40,
                                "timings": {},
                                "created_at": rows[n]["created_at"],
                            }
                        )
                async with engine.begin() as conn:
                    await conn.execute(insert(Episode), rows)
                    await conn.execute(insert(Turn), turns)
                    await conn.execute(
                        update(Episode)
                        .where(Episode.id.in_(ids))
                        .values(
                            status="completed",
                            reward=0.5,
                            min_weight_version=first // 500,
                            max_weight_version=(first + CHUNK) // 500,
                        )
                    )
    finally:
        await engine.dispose()
    return run_ids[0]


async def set_run_indexes(url: str, present: bool) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            if present:
                await conn.execute(text("CREATE INDEX ix_episodes_run_id ON episodes (run_id)"))
                await conn.execute(
                    text(
                        "CREATE INDEX ix_episodes_run_id_created_at "
                        "ON episodes (run_id, created_at)"
                    )
                )
            else:
                for name in RUN_INDEXES:
                    await conn.execute(text(f"DROP INDEX {name}"))
            await conn.execute(text("ANALYZE"))
    finally:
        await engine.dispose()


@contextmanager
def gateway(url: str, cwd: Path) -> Iterator[str]:
    """`agentflow serve` on a free port, with the key; its base URL."""
    port = _free_port()
    with gateway_process(url, cwd, port, AGENTFLOW_API_KEY=KEY):
        yield f"http://127.0.0.1:{port}"


async def measure(base: str, run_id: uuid.UUID, repeat: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    api_path = f"{base}/ui/api/runs/{run_id}/episodes?limit=50&offset=0"
    async with httpx.AsyncClient(headers=headers) as client:
        await client.get(api_path)  # warm: the connection pool, the statement cache
        api = []
        for _ in range(repeat * 4):
            began = time.perf_counter()
            answer = await client.get(api_path)
            api.append(time.perf_counter() - began)
            assert answer.status_code == 200 and len(answer.json()["items"]) == 50
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_executable(headless=True)
        )
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/ui")
            await page.fill("#key", KEY)
            await page.click("button[type=submit]")
            await page.wait_for_selector("main[data-page=runs]")
            loads = []
            for attempt in range(repeat + 1):
                await page.goto("about:blank")
                began = time.perf_counter()
                await page.goto(f"{base}/ui#/runs/{run_id}/episodes")
                # A locator, not a script: the page's CSP allows no eval.
                await page.locator("table.episodes tbody tr").nth(49).wait_for()
                if attempt:  # the first load fills the browser's cache of the assets
                    loads.append(time.perf_counter() - began)
        finally:
            await browser.close()
    return {
        "api_ms": statistics.median(api) * 1e3,
        "page_ms": statistics.median(loads) * 1e3,
        "page_max_ms": max(loads) * 1e3,
    }


def bench(url: str, episodes: int, repeat: int, workdir: Path) -> dict[str, dict[str, float]]:
    run_id = asyncio.run(seed(url, episodes))
    results = {}
    asyncio.run(set_run_indexes(url, present=False))
    with gateway(url, workdir) as base:
        results["baseline"] = asyncio.run(measure(base, run_id, repeat))
    asyncio.run(set_run_indexes(url, present=True))
    with gateway(url, workdir) as base:
        results["indexed"] = asyncio.run(measure(base, run_id, repeat))
    return results


def report(name: str, results: dict[str, dict[str, float]]) -> None:
    base, new = results["baseline"], results["indexed"]
    print(f"\n{name}")
    print(f"  {'':<26}{'API (median)':>14}{'page (median)':>15}{'page (max)':>12}")
    for label, row in (("without the run indexes", base), ("with them (migrated)", new)):
        print(
            f"  {label:<26}{row['api_ms']:>11.1f} ms{row['page_ms']:>12.1f} ms"
            f"{row['page_max_ms']:>9.1f} ms"
        )
    print(
        f"  speed-up: API {base['api_ms'] / new['api_ms']:.1f}x, "
        f"page {base['page_ms'] / new['page_ms']:.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--pg-url",
        default="postgresql+asyncpg://postgres@127.0.0.1:5432/test",
        help="maintenance database; a scratch database is made beside it",
    )
    args = parser.parse_args()
    print(f"a run of {args.episodes} episodes (3 turns each), beside two more such runs")
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        sqlite_url = f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
        migrate.upgrade(sqlite_url)
        report("SQLite", bench(sqlite_url, args.episodes, args.repeat, workdir))
        with scratch_database(args.pg_url, prefix="agentflow_bench") as pg_url:
            report("PostgreSQL", bench(pg_url, args.episodes, args.repeat, workdir))


if __name__ == "__main__":
    main()
