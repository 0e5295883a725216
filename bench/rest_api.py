"""REST read throughput: the real gateway against a bare FastAPI app doing the same work.

Starts `agentflow serve` on a scratch PostgreSQL database with a few envs registered, and
a bare app (defined below: no middleware, no dependencies, SQLAlchemy Core and a plain
JSON response) on the same database, each one uvicorn worker with the same settings. Both
answer `/livez` (a constant), `/readyz` (SELECT 1) and `/v1/envs` (the same two queries,
the same JSON). wrk loads each route of each server in turn, alternating, for `--rounds`
rounds; the table gives each server's median round: req/s, the ratio bare/gateway, p50/p99
latency, and the server process's CPU time per request, which moves less than req/s when
other work shares the machine's cores.

    python bench/rest_api.py [--duration 10] [--connections 20] [--threads 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, only bench/ is on sys.path: `tests` imports from the root.
sys.path.insert(0, str(ROOT))
from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database  # noqa: E402

ROUTES = ("/livez", "/readyz", "/v1/envs")
UVICORN_SETTINGS: dict[str, Any] = {"host": "127.0.0.1", "log_level": "info"}  # as `serve`


def bare_app(database_url: str) -> Any:
    """The same three routes with nothing but FastAPI, SQLAlchemy Core and uvicorn."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from sqlalchemy import func, select, text
    from sqlalchemy.ext.asyncio import create_async_engine

    from agentflow.db.models import Environment

    # Autocommit: no BEGIN/ROLLBACK around the reads, as the gateway's read routes do.
    engine = create_async_engine(
        database_url, pool_size=20, max_overflow=20, isolation_level="AUTOCOMMIT"
    )
    envs = Environment.__table__
    app = FastAPI()

    @app.get("/livez")
    async def livez() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        return JSONResponse({"status": "ok", "database": "ok"})

    @app.get("/v1/envs")
    async def list_envs(limit: int = 50, offset: int = 0) -> JSONResponse:
        query = select(envs)
        async with engine.connect() as conn:
            total = await conn.scalar(select(func.count()).select_from(query.subquery()))
            rows = await conn.execute(
                query.order_by(envs.c.created_at, envs.c.id).limit(limit).offset(offset)
            )
            items = [
                {
                    **row,
                    "id": str(row["id"]),
                    "created_at": _iso(row["created_at"]),
                    "updated_at": _iso(row["updated_at"]),
                }
                for row in rows.mappings()
            ]
        return JSONResponse({"items": items, "total": total, "limit": limit, "offset": offset})

    return app


def _iso(value: Any) -> str:
    return str(value.isoformat().replace("+00:00", "Z"))  # pydantic's form of UTC


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx answers and socket errors
    requests: int
    cpu_ms: float = 0.0  # the server process's CPU time per request


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(value: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", value)
    if match is None:
        raise RuntimeError(f"unexpected wrk latency {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(output: str) -> Load:
    percentiles = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", output, re.M))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(r"Socket errors: (.*)", output)
    errors = int(non_2xx.group(1)) if non_2xx else 0
    if socket_errors:
        errors += sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1)))
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    requests = re.search(r"(\d+) requests in", output)
    if rate is None or requests is None or not percentiles:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    p50, p99 = _ms(percentiles["50"]), _ms(percentiles["99"])
    return Load(float(rate.group(1)), p50, p99, errors, int(requests.group(1)))


def wrk(server: Server, route: str, args: argparse.Namespace) -> Load:
    command = ["wrk", "--latency", f"-t{args.threads}", f"-c{args.connections}"]
    command += [f"-d{args.duration}s", server.url + route]
    cpu = server.cpu_s()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    load = parse_wrk(done.stdout)
    cpu_ms = (server.cpu_s() - cpu) * 1e3 / max(load.requests, 1)
    return replace(load, cpu_ms=cpu_ms)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _process(command: list[str], database_url: str, log: IO[bytes]) -> Iterator[Server]:
    """Start a server on a free port, yield it once `/readyz` answers, stop it."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTFLOW_")}  # no API key
    env |= {"AGENTFLOW_DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [*command, "--port", str(port)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(f"{command} did not start:\n{Path(log.name).read_text()}")
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield Server(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def register_envs(url: str, count: int) -> None:
    for i in range(count):
        body = {
            "name": f"bench/env-{i}",
            "kind": "python",
            "spec": {"entry_point": "envs.builtin:Echo", "kwargs": {"seed": i}},
            "tools": [{"type": "function", "function": {"name": "submit"}}],
            "description": "a registered env for the REST benchmark",
        }
        httpx.post(f"{url}/v1/envs", json=body, timeout=10).raise_for_status()


def bench(database_url: str, args: argparse.Namespace) -> dict[str, tuple[Load, Load]]:
    with ExitStack() as stack:
        logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="rest_api_bench"))
        gateway_log = stack.enter_context(open(Path(logs) / "gateway.log", "wb"))
        bare_log = stack.enter_context(open(Path(logs) / "bare.log", "wb"))
        serve = [sys.executable, "-m", "trainer.cli", "serve"]
        gateway = stack.enter_context(_process(serve, database_url, gateway_log))
        register_envs(gateway.url, args.envs)
        bare_server = [sys.executable, __file__, "--serve-bare"]
        bare = stack.enter_context(_process(bare_server, database_url, bare_log))
        same = httpx.get(f"{gateway.url}/v1/envs").json() == httpx.get(f"{bare.url}/v1/envs").json()
        assert same, "the bare app's /v1/envs differs from the gateway's"
        warm_up = argparse.Namespace(**{**vars(args), "duration": args.warm_up})
        results = {}
        for route in args.route or ROUTES:
            if args.warm_up:
                wrk(gateway, route, warm_up)
                wrk(bare, route, warm_up)
            rounds = [  # alternated, so a drift in the machine's load hits both alike
                (wrk(gateway, route, args), wrk(bare, route, args)) for _ in range(args.rounds)
            ]
            results[route] = (_median([g for g, _ in rounds]), _median([b for _, b in rounds]))
        return results


def _median(loads: list[Load]) -> Load:
    """The round with the median rate."""
    return sorted(loads, key=lambda load: load.rate)[len(loads) // 2]


def print_table(results: dict[str, tuple[Load, Load]]) -> None:
    header = ["route", "gateway req/s", "bare req/s", "ratio", "gateway p50/p99 ms"]
    header += ["bare p50/p99 ms", "CPU ms/req gateway/bare"]
    rows = [header]
    for route, (gateway, bare) in results.items():
        rows.append(
            [
                route,
                f"{gateway.rate:.0f}",
                f"{bare.rate:.0f}",
                f"{bare.rate / gateway.rate:.2f}",
                f"{gateway.p50_ms:.1f}/{gateway.p99_ms:.1f}",
                f"{bare.p50_ms:.1f}/{bare.p99_ms:.1f}",
                f"{gateway.cpu_ms:.2f}/{bare.cpu_ms:.2f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    for route, (gateway, bare) in results.items():
        if gateway.errors or bare.errors:
            print(f"{route}: {gateway.errors} failed requests on the gateway, {bare.errors} bare")
    print("ratio: bare req/s over gateway req/s (target <= 1.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds of load per route")
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="report each server's median")
    parser.add_argument("--warm-up", type=int, default=1, help="seconds of load first, unmeasured")
    parser.add_argument("--envs", type=int, default=10, help="envs registered before the load")
    parser.add_argument("--route", action="append", choices=ROUTES, help="default: all")
    parser.add_argument("--pg-url", default=DEFAULT_ADMIN_URL)
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:  # the bare app's own process
        import uvicorn

        app = bare_app(os.environ["AGENTFLOW_DATABASE_URL"])
        uvicorn.run(app, port=args.port, **UVICORN_SETTINGS)
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; PostgreSQL")
    print(
        f"wrk -t{args.threads} -c{args.connections} -d{args.duration}s per route and server,"
        f" {args.rounds} round(s)"
    )
    with scratch_database(args.pg_url, prefix="agentflow_bench") as url:
        print_table(bench(url, args))


if __name__ == "__main__":
    main()
