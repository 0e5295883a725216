"""What the gateway adds per turn: the white-box loop with persistence on PostgreSQL,
against calling the same engine and env directly, in one run.

The engine answers instantly (a fixed reply, no model) and the env is trivial, so the
difference is the gateway's own cost: chat-template deltas, bookkeeping, and writing
every turn to the database. Prints p50/p99 per-turn latency of both at concurrency 1,
the added time, and turns/s of the gateway with many episodes at once.

`--pool N` instead measures the HTTP pool to the engine with N live episodes: N
generations at once through `SGLangEngine` against a mock SGLang worker on loopback
whose every answer takes `--server-s`, with httpx's default pool (100 connections) and
with the pool sized from the config (`rollout.max_concurrency` + 16). The time a request
spends beyond the server's is its wait for a connection.

    python bench/gateway_overhead.py [--turns 20] [--episodes 200] [--concurrency 64]
                                     [--loop uvloop|asyncio]
    python bench/gateway_overhead.py --pool 256 [--server-s 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
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
    print(f"  added by the gateway p50 {(g50 - d50) * 1e3:.3f} ms per turn (target <= 0.3 ms)")

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


class _Worker:
    """A mock SGLang worker (tests/support/mock_sglang.py) in its own process, so that
    its work does not share this process's event loop (and GIL) with the client's."""

    def __init__(self, server_s: float) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server_s = server_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Worker:
        import httpx

        command = [sys.executable, __file__, "--serve-mock", str(self.port)]
        command += ["--server-s", str(self.server_s)]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass  # not listening yet: ask again below
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.__exit__()
                raise RuntimeError("the mock worker did not start")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


def serve_mock(port: int, server_s: float) -> None:
    import uvicorn

    from tests.support.mock_sglang import create_mock_worker

    engine = MockEngine(lambda request, engine: REPLY, delay_s=server_s, max_context=1 << 16)
    uvicorn.run(
        create_mock_worker(engine),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        backlog=4096,
        timeout_keep_alive=120,
        ws="none",
    )


def _timed_transport(limits: object, waits: list[float], connects: list[int]) -> object:
    """An httpx transport that records each request's wait for a pooled connection (the
    time from its start to its first event on a connection: connect or send) and each
    new TCP connection it opens."""
    import httpx

    class Timed(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            start = time.perf_counter()
            seen: list[float] = []

            async def trace(event: str, info: dict[str, object]) -> None:
                if not seen:
                    seen.append(time.perf_counter())
                if event == "connection.connect_tcp.started":
                    connects.append(1)

            request.extensions["trace"] = trace
            try:
                return await super().handle_async_request(request)
            finally:
                if request.url.path == "/generate" and seen:
                    waits.append(seen[0] - start)

    return Timed(limits=limits)  # type: ignore[arg-type]


async def pool_wait(episodes: int, server_s: float) -> None:
    """`--pool`: see the module docstring."""
    import httpx

    from agentflow.inference.sglang import SGLangEngine, SGLangSettings

    print(f"{episodes} generations at once, the server takes {server_s * 1e3:.0f} ms each:")
    with _Worker(server_s) as worker:
        sized = SGLangSettings(url=worker.url, max_connections=episodes + 16)
        one_pool = sized.max_connections
        cases = (
            ("one httpx pool, default (100)", [httpx.Limits()]),
            (
                f"one pool of {one_pool}",
                [httpx.Limits(max_connections=one_pool, max_keepalive_connections=one_pool)],
            ),
            (
                f"{sized.clients()} pools of {sized.connections_per_client} (the engine's)",
                [sized.http_limits()] * sized.clients(),
            ),
        )
        for label, pools in cases:
            waits: list[float] = []
            connects: list[int] = []
            clients = [
                httpx.AsyncClient(transport=_timed_transport(limits, waits, connects))  # type: ignore[arg-type]
                for limits in pools
            ]
            engine = SGLangEngine(sized, client=clients[0])
            engine._generate_clients = clients  # the pools under test
            request = GenerateRequest(
                input_ids=tuple(REPLY), sampling=SamplingParams(max_new_tokens=16)
            )

            async def one(
                rid: str, engine: SGLangEngine = engine, request: GenerateRequest = request
            ) -> None:
                await engine.generate(request.model_copy(update={"rid": rid}))

            walls = []
            for round_ in range(3):  # the first round opens the connections
                waits.clear()
                connects.clear()
                start = time.perf_counter()
                await asyncio.gather(*(one(f"{round_}-{i}") for i in range(episodes)))
                walls.append(time.perf_counter() - start)
            for client in clients:
                await client.aclose()
            waits.sort()
            print(
                f"  {label:34s} wall per round {walls[1]:5.2f} s, {walls[2]:5.2f} s "
                f"(server {server_s:.2f} s)  wait for a connection p50 "
                f"{statistics.median(waits) * 1e3:6.1f} ms  p99 {_pct(waits, 99) * 1e3:6.1f} ms  "
                f"new connections in the last round {len(connects)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--latency-episodes", type=int, default=30)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--pg-url", default=DEFAULT_ADMIN_URL)
    parser.add_argument("--pool", type=int, default=0, help="live episodes for the pool check")
    parser.add_argument("--server-s", type=float, default=1.0)
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="uvloop",
        help="the event loop (the gateway runs on uvloop, uvicorn's choice when installed)",
    )
    parser.add_argument("--serve-mock", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock, args.server_s)
        return
    if args.pool:
        asyncio.run(pool_wait(args.pool, args.server_s))
        return
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; PostgreSQL; "
        f"loop {args.loop}"
    )
    factory = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with scratch_database(args.pg_url, prefix="agentflow_bench") as url:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(bench(url, args))


if __name__ == "__main__":
    main()
