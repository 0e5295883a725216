"""Env server under load: many concurrent sessions stepping over loopback HTTP.

Baseline and candidates in the same run, each ``--sessions`` concurrent sessions playing
guess-number episodes with the oracle until ``--steps`` steps each are done:
- baseline: the same envs stepped in process (no server);
- server: the env server (``python -m envs.server``, a separate process on 127.0.0.1)
  driven by a lean aiohttp load generator speaking the session protocol, so the figure
  is the server's;
- RemoteEnv: the same server driven through our :class:`RemoteEnv` (httpx, one client
  per env), so the figure is what an agent loop sees end to end.
Prints p50/p99 step latency and steps/s for each, the ratios, the error count (must be
0), and the sandbox's per-exec overhead against a bare subprocess
(``bench/sandbox_exec.py``).

    python bench/env_server.py --sessions 200 --steps 25
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from envs import registry  # noqa: E402
from envs.base import Env, StepResult  # noqa: E402
from envs.client import RemoteEnv  # noqa: E402

ENV_ID = "agentflow/guess-number-v0"


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _summary(latencies: list[float], wall_s: float) -> dict[str, float]:
    if not latencies:
        return {"steps": 0, "p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "steps_per_s": 0.0}
    return {
        "steps": len(latencies),
        "p50_ms": _percentile(latencies, 0.50) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "steps_per_s": len(latencies) / wall_s,
    }


async def _play(env: Env, steps: int, seed: int, latencies: list[float]) -> None:
    """Step ``env`` with the oracle until ``steps`` steps are done, resetting as needed."""
    oracle = registry.oracle(ENV_ID)
    done_steps, episode = 0, 0
    while done_steps < steps:
        history = [(await env.reset(seed=seed * 1000 + episode)).observation]
        episode += 1
        result = None
        while (result is None or not result.done) and done_steps < steps:
            start = time.perf_counter()
            result = await env.step(oracle(history), timeout_s=30)
            latencies.append(time.perf_counter() - start)
            history.append(result.observation)
            done_steps += 1


async def bench_in_process(sessions: int, steps: int) -> dict[str, float]:
    latencies: list[float] = []
    envs = [registry.make(ENV_ID) for _ in range(sessions)]
    start = time.perf_counter()
    await asyncio.gather(*(_play(env, steps, i, latencies) for i, env in enumerate(envs)))
    wall = time.perf_counter() - start
    await asyncio.gather(*(env.close() for env in envs))
    return _summary(latencies, wall)


def _count_errors(results: list[object]) -> int:
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors[:5]:
        print(f"  session error: {type(error).__name__}: {error}", file=sys.stderr)
    return len(errors)


async def bench_remote_env(url: str, sessions: int, steps: int) -> tuple[dict[str, float], int]:
    """Our RemoteEnv, one httpx client per env (its default).

    One httpx client shared by hundreds of sessions is several times slower (its
    connection pool contends), so each env keeps its own.
    """
    latencies: list[float] = []
    envs = [RemoteEnv(url, env=ENV_ID, timeout_s=60) for _ in range(sessions)]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(_play(env, steps, i, latencies) for i, env in enumerate(envs)),
        return_exceptions=True,
    )
    wall = time.perf_counter() - start
    errors = _count_errors(list(results))
    closed = await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)
    return _summary(latencies, wall), errors + _count_errors(list(closed))


async def _play_raw(
    http: aiohttp.ClientSession, url: str, steps: int, seed: int, latencies: list[float]
) -> None:
    """The session protocol spoken directly: create, step, reset, ..., delete."""
    oracle = registry.oracle(ENV_ID)
    async with http.post(f"{url}/v1/sessions", json={"env": ENV_ID, "seed": seed}) as response:
        response.raise_for_status()
        created = await response.json()
    sid = created["session_id"]
    first = StepResult.model_validate(created["result"])
    history, done_steps, episode = [first.observation], 0, 0
    while done_steps < steps:
        start = time.perf_counter()
        body = {"action": oracle(history).model_dump(mode="json"), "request_id": str(done_steps)}
        async with http.post(f"{url}/v1/sessions/{sid}/step", json=body) as response:
            response.raise_for_status()
            result = StepResult.model_validate(await response.json())
        latencies.append(time.perf_counter() - start)
        history.append(result.observation)
        done_steps += 1
        if result.done:
            episode += 1
            reset_body = {"seed": seed * 1000 + episode}
            async with http.post(f"{url}/v1/sessions/{sid}/reset", json=reset_body) as response:
                response.raise_for_status()
                history = [StepResult.model_validate(await response.json()).observation]
    async with http.delete(f"{url}/v1/sessions/{sid}") as response:
        response.raise_for_status()


async def bench_server(url: str, sessions: int, steps: int) -> tuple[dict[str, float], int]:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=sessions)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_play_raw(http, url, steps, i, latencies) for i in range(sessions)),
            return_exceptions=True,
        )
        wall = time.perf_counter() - start
    return _summary(latencies, wall), _count_errors(list(results))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(port: int, max_sessions: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "envs.server", ENV_ID, "--port", str(port),
        "--max-sessions", str(max_sessions), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("env server did not start")


async def main_async(args: argparse.Namespace) -> int:
    print(f"{ENV_ID}: {args.sessions} concurrent sessions x {args.steps} steps each")
    baseline = await bench_in_process(args.sessions, args.steps)
    port = _free_port()
    server = _start_server(port, max_sessions=args.sessions + 10)
    try:
        url = f"http://127.0.0.1:{port}"
        server_figures, server_errors = await bench_server(url, args.sessions, args.steps)
        client_figures, client_errors = await bench_remote_env(url, args.sessions, args.steps)
        health = httpx.get(f"{url}/healthz", timeout=5).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = (
        ("in process", baseline),
        ("env server", server_figures),
        ("RemoteEnv", client_figures),
    )
    for name, figures in rows:
        print(
            f"  {name:11s} steps {figures['steps']:6.0f}  p50 {figures['p50_ms']:8.2f} ms  "
            f"p99 {figures['p99_ms']:8.2f} ms  {figures['steps_per_s']:8.0f} steps/s"
        )
    for name, figures in rows[1:]:
        print(
            f"  ratio {name}/in-process: p50 latency "
            f"{figures['p50_ms'] / baseline['p50_ms']:.1f}x, "
            f"throughput {figures['steps_per_s'] / baseline['steps_per_s']:.3f}x"
        )
    errors = server_errors + client_errors
    print(f"  errors: {errors}; sessions left open on the server: {health['sessions']}")

    from sandbox_exec import measure_exec_overhead

    sandbox = await measure_exec_overhead(args.exec_n)
    bare, bwrap = sandbox["bare"], sandbox["bwrap"]
    assert isinstance(bare, dict) and isinstance(bwrap, dict)
    print(f"sandbox exec of /bin/true x{args.exec_n} (cgroup: {sandbox['cgroup_enforced']})")
    print(f"  bare subprocess p50 {bare['p50_ms']:.2f} ms, bwrap p50 {bwrap['p50_ms']:.2f} ms")
    print(
        f"  overhead p50 {sandbox['overhead_ms_p50']:.2f} ms per exec; "
        f"ratio bwrap/bare p50 {sandbox['ratio_p50']:.2f}x"
    )
    expected = args.sessions * args.steps
    steps_ok = server_figures["steps"] == client_figures["steps"] == expected
    if errors or not steps_ok or health["sessions"]:
        print("FAILED: errors, missing steps, or leaked sessions", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--steps", type=int, default=25, help="steps per session")
    parser.add_argument("--exec-n", type=int, default=100, help="sandbox execs to time")
    args = parser.parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
