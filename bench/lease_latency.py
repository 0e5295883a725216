"""A trajectory lease over HTTP: FastAPI's encoder and the standard library (how the route
answered before) against orjson straight from the dataclasses (how it answers now), in
one process.

Both routes serve the same 64 trajectories of 4,096 tokens each (token ids, log-probs,
loss mask and weight versions per token) through FastAPI on an in-process ASGI transport,
and the client decodes them into `Trajectory` objects as the split trainer does, with
`json` before and `orjson` now. Prints the median time of each part and the ratios.

    python bench/lease_latency.py [--trajectories 64] [--tokens 4096] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Response

from agentflow.api.routes.trajectory_stream import lease_body
from agentflow.rollout.stream import trajectory_from_json
from agentflow.types import Trajectory


def trajectories(n: int, tokens: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = 8
        out.append(
            Trajectory(
                id=uuid.uuid4(),
                run_id=uuid.uuid4(),
                episode_id=uuid.uuid4(),
                group_id="g",
                leaf_turn_id=uuid.uuid4(),
                reward=rng.random(),
                status="leased",
                times_served=1,
                min_weight_version=3,
                created_at=datetime.now(UTC),
                turn_ids=tuple(uuid.uuid4() for _ in range(turns)),
                turn_starts=tuple(range(0, tokens, tokens // turns)),
                token_ids=tuple(rng.randrange(150_000) for _ in range(tokens)),
                logprobs=tuple(-rng.random() * 5 for _ in range(tokens)),
                loss_mask=tuple(rng.randrange(2) for _ in range(tokens)),
                weight_versions=tuple(3 for _ in range(tokens)),
                lease_id=uuid.uuid4().hex,
                env_ref="agentflow/guess-number-v0",
                turn_rewards=tuple(0.0 for _ in range(turns)),
            )
        )
    return out


def app_for(served: list[Trajectory]) -> FastAPI:
    app = FastAPI()

    @app.post("/before")
    async def before() -> dict[str, Any]:  # FastAPI's jsonable_encoder + json.dumps
        return {"trajectories": [asdict(t) for t in served]}

    @app.post("/now", response_model=None)
    async def now() -> Response:
        return Response(lease_body(served), media_type="application/json")

    return app


async def timed(client: httpx.AsyncClient, route: str, loads: Any) -> tuple[float, float]:
    start = time.perf_counter()
    response = await client.post(route)
    got = time.perf_counter()
    parsed = [trajectory_from_json(t) for t in loads(response.content)["trajectories"]]
    assert len(parsed) > 0
    return got - start, time.perf_counter() - got


async def bench(args: argparse.Namespace) -> None:
    served = trajectories(args.trajectories, args.tokens)
    app = app_for(served)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        size = len((await client.post("/now")).content)
        results: dict[str, list[tuple[float, float]]] = {"before": [], "now": []}
        for _ in range(args.repeat):  # interleaved, so drifts hit both alike
            results["before"].append(await timed(client, "/before", json.loads))
            results["now"].append(await timed(client, "/now", orjson.loads))
    print(
        f"lease of {args.trajectories} trajectories x {args.tokens} tokens "
        f"({size / 1e6:.1f} MB of JSON), median of {args.repeat}:"
    )
    medians = {}
    for name, rows in results.items():
        serve = statistics.median(r[0] for r in rows)
        decode = statistics.median(r[1] for r in rows)
        medians[name] = (serve, decode)
        print(
            f"  {name:6s} served in {serve * 1e3:8.1f} ms  decoded in {decode * 1e3:8.1f} ms  "
            f"total {(serve + decode) * 1e3:8.1f} ms"
        )
    (bs, bd), (ns, nd) = medians["before"], medians["now"]
    print(
        f"  ratio before/now: serving {bs / ns:.1f}x, decoding {bd / nd:.1f}x, "
        f"whole lease {(bs + bd) / (ns + nd):.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
