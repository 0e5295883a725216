"""A burst of mixed requests against `agentflow serve`: transport errors, statuses, latency.

Starts the real gateway (`agentflow serve`, an API key set) on a free loopback port with
a scratch database (SQLite, PostgreSQL or both, one after the other), registers an env
and a run (not started), then sends `--runs` bursts. Each burst is `--requests`
requests, a third `POST /v1/envs` (a new env each), a third `GET /v1/envs`, a third
`GET /v1/runs/{id}`, `--concurrency` of them in flight at once (`--waves`: that many,
then the next that many once all are answered), from one stock `httpx.AsyncClient`
(default limits: 100 connections, 20 kept alive for 5 s; 5 s timeouts), a new client
per burst.

`--edge N` adds N more stock clients for the length of each burst, each sending
`GET /v1/envs` again on its pooled connection just before httpx would expire it (1 to 15
ms before `keepalive_expiry`, 5 s after the previous response), while the burst keeps
the gateway busy: the timing of a client that polls every few seconds, or of a pool
whose connections wait out a slow tail between waves. Their requests are reported on
their own line.

Each run prints its transport errors by type, its statuses and p50/p99/max latency, how
many requests went out on a reused connection, the most sockets seen at once on the
gateway's port (its accept queue, each TCP state; `ss`) and the gateway's most file
descriptors, and the kernel's TCP counters that moved (`nstat`: the whole network
namespace's, so other traffic on the machine adds to them). Every transport error other
than a timeout is listed with its cause (the innermost exception) and what its
connection had been through, observed in the client's pool: new or reused, the
request's number on it, how long it had lain idle, its age, its local port; with
`--trace-server` the gateway runs with uvicorn's TRACE log and the failure's lines of it
(by that port: connection made, requests, connection lost) are shown too.

    python -m bench.burst [--runs 10] [--requests 1000] [--concurrency 200] [--waves]
                          [--edge 20] [--db sqlite|postgresql|both] [--trace-server]

Exits 1 if any run had a transport error.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpcore
import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, only bench/ would be on sys.path
    sys.path.insert(0, str(ROOT))
from tests.support.scratch_db import DEFAULT_ADMIN_URL, scratch_database  # noqa: E402

AGENTFLOW = [sys.executable, "-m", "trainer.cli"]
# `agentflow serve` with uvicorn's log at its TRACE level (every connection made and lost,
# by the client's address and port) and timestamped, for `--trace-server`.
TRACED_SERVE = [
    sys.executable,
    "-c",
    """
import uvicorn, uvicorn.config
from trainer.cli import main
for formatter in uvicorn.config.LOGGING_CONFIG["formatters"].values():
    formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
_init = uvicorn.Config.__init__
def _traced(self, *args, **kwargs):
    _init(self, *args, **{**kwargs, "log_level": "trace"})
uvicorn.Config.__init__ = _traced
main()
""",
]
NSTAT_COUNTERS = (
    "TcpExtListenOverflows",
    "TcpExtListenDrops",
    "TcpExtTCPReqQFullDrop",
    "TcpEstabResets",
    "TcpOutRsts",
    "TcpExtTCPAbortOnData",
    "TcpExtTCPAbortOnClose",
)
EDGE_ROUTE = "GET /v1/envs at the keep-alive edge"
KEEPALIVE_EXPIRY_S = httpx.Limits().keepalive_expiry or 5.0  # a stock client's


@dataclass
class ConnectionLog:
    """What one pooled connection has been through, as the client saw it."""

    opened: float
    opened_at: float  # wall clock
    port: int | None
    requests: int = 0
    last_closed: float | None = None  # when its previous response was closed


@dataclass
class Outcome:
    route: str
    latency_s: float = 0.0
    status: int | None = None
    error: str | None = None
    cause: str | None = None  # the innermost exception under it (an OSError's errno)
    # The connection the request went out on (from the pool observer).
    reused: bool | None = None
    number: int | None = None  # the request's number on its connection, from 1
    idle_s: float | None = None  # how long the connection had lain idle before it
    age_s: float | None = None
    port: int | None = None
    opened_at: float | None = None  # wall clock, to find the connection in the gateway's log
    ended_at: float | None = None


@dataclass
class PoolObserver:
    """Records, per request, the connection httpcore sent it on.

    httpcore's trace extension names no connection for a reused one, so this wraps
    `AsyncHTTP11Connection.handle_async_request` and `_response_closed` while the bench
    runs; it only observes (the wrapped calls are awaited as they are).
    """

    # Keyed by the connection itself: an id() is reused once a closed one is collected.
    connections: weakref.WeakKeyDictionary[Any, ConnectionLog] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    current: dict[int, Outcome] = field(default_factory=dict)  # id(key) -> its outcome

    @contextmanager
    def installed(self) -> Iterator[None]:
        cls = httpcore.AsyncHTTP11Connection
        original = cls.handle_async_request
        original_closed = cls._response_closed
        observer = self

        async def handle(conn: Any, request: httpcore.Request) -> httpcore.Response:
            observer.before(conn, request)
            try:
                return await original(conn, request)
            except BaseException:
                observer.closed(conn)
                raise

        async def response_closed(conn: Any) -> None:
            observer.closed(conn)
            await original_closed(conn)

        cls.handle_async_request = handle  # type: ignore[method-assign,assignment]
        cls._response_closed = response_closed  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            cls.handle_async_request = original  # type: ignore[method-assign]
            cls._response_closed = original_closed  # type: ignore[method-assign]

    def before(self, conn: Any, request: httpcore.Request) -> None:
        now = time.monotonic()
        log = self.connections.get(conn)
        if log is None:
            addr = conn._network_stream.get_extra_info("client_addr")
            port = addr[1] if addr else None
            log = self.connections[conn] = ConnectionLog(now, time.time(), port)
        log.requests += 1
        outcome = self.current.get(id(request.extensions.get("outcome_key")))
        if outcome is not None:
            outcome.reused = log.requests > 1
            outcome.number = log.requests
            outcome.idle_s = None if log.last_closed is None else now - log.last_closed
            outcome.age_s = now - log.opened
            outcome.port = log.port
            outcome.opened_at = log.opened_at

    def closed(self, conn: Any) -> None:
        log = self.connections.get(conn)
        if log is not None:
            log.last_closed = time.monotonic()

    async def send(
        self, client: httpx.AsyncClient, route: str, method: str, url: str, **kwargs: Any
    ) -> Outcome:
        key = object()  # names this request to `before`, through the request's extensions
        request = client.build_request(method, url, extensions={"outcome_key": key}, **kwargs)
        outcome = self.current[id(key)] = Outcome(route)
        started = time.perf_counter()
        try:
            response = await client.send(request)
            outcome.status = response.status_code
        except httpx.TransportError as exc:
            outcome.error = type(exc).__name__
            inner: BaseException = exc
            while (under := inner.__cause__ or inner.__context__) is not None:
                inner = under
            outcome.cause = repr(inner)
        finally:
            outcome.latency_s = time.perf_counter() - started
            outcome.ended_at = time.time()
            del self.current[id(key)]
        return outcome


@dataclass
class SocketSampler:
    """`ss` on the gateway's port every 0.1 s while a burst runs: the most connections
    seen waiting in the listener's accept queue (its Recv-Q) and in each TCP state, and
    the most file descriptors the gateway held."""

    port: int
    pid: int
    accept_queue: int = 0
    backlog: int = 0
    states: Counter[str] = field(default_factory=Counter)
    fds: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _sample(self) -> None:
        out = subprocess.run(
            ["ss", "-Htan", f"( sport = :{self.port} )"], capture_output=True, text=True
        ).stdout
        states: Counter[str] = Counter()
        for line in out.splitlines():
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "LISTEN":  # Recv-Q: waiting to be accepted; Send-Q: the backlog
                self.accept_queue = max(self.accept_queue, int(parts[1]))
                self.backlog = int(parts[2])
            else:
                states[parts[0]] += 1
        for state, count in states.items():
            self.states[state] = max(self.states[state], count)
        try:
            self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    @contextmanager
    def sampling(self) -> Iterator[SocketSampler]:
        if shutil.which("ss") is None:
            yield self
            return
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()

    def summary(self) -> str:
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))
        return (
            f"accept queue {self.accept_queue} (backlog {self.backlog}), {states};"
            f" gateway fds {self.fds}"
        )


def nstat() -> dict[str, int]:
    if shutil.which("nstat") is None:
        return {}
    out = subprocess.run(["nstat", "-az"], capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in NSTAT_COUNTERS:
            values[parts[0]] = int(parts[1])
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Gateway:
    url: str
    port: int
    pid: int
    log: Path
    traced: bool

    def lines_about(self, o: Outcome) -> list[str]:
        """With --trace-server: the gateway's log lines about the failed request's
        connection (its client port, from when it was opened to the failure): the
        connection made, its requests, the connection lost."""
        if not self.traced or o.port is None or o.opened_at is None or o.ended_at is None:
            return []
        needle = f"127.0.0.1:{o.port} "
        lines = []
        for line in self.log.read_text(errors="replace").splitlines():
            if needle not in line:
                continue
            try:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            if o.opened_at - 0.2 <= stamp <= o.ended_at + 0.2:
                lines.append(line)
        return lines


def _die_with_the_bench() -> None:
    """In the gateway's process before it runs: SIGTERM when the bench's dies, however it
    dies (a test that kills the bench on its timeout would leave the gateway serving)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def gateway(
    database_url: str, api_key: str, log_path: Path, *, traced: bool = False
) -> Iterator[Gateway]:
    """`agentflow serve` on a free loopback port until /readyz answers; stopped after."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTFLOW_")}
    env |= {
        "AGENTFLOW_DATABASE_URL": database_url,
        "AGENTFLOW_API_KEY": api_key,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",  # the log as it happens, for --trace-server
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*(TRACED_SERVE if traced else AGENTFLOW), "serve", "--port", str(port)],
            env=env,
            cwd=log_path.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_the_bench,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not start:\n{log_path.read_text()}")
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            yield Gateway(url, port, proc.pid, log_path, traced)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def setup(url: str, headers: dict[str, str]) -> str:
    """One env and one run (not started) to read; returns the run's id."""
    name = f"burst/base-{uuid.uuid4().hex[:8]}"
    env = {"name": name, "kind": "http", "spec": {"url": "http://127.0.0.1:9"}}
    httpx.post(f"{url}/v1/envs", json=env, headers=headers, timeout=30).raise_for_status()
    run = {"name": f"burst-{uuid.uuid4().hex[:8]}", "envs": [{"id": name}]}
    created = httpx.post(
        f"{url}/v1/runs", json=run, params={"start": "false"}, headers=headers, timeout=30
    )
    created.raise_for_status()
    return str(created.json()["id"])


def make_client(headers: dict[str, str], args: argparse.Namespace) -> httpx.AsyncClient:
    """A stock client: default limits, and the default 5 s timeouts unless `--timeout`
    says otherwise (0: none, so a loaded machine shows what fails besides the waiting)."""
    if args.timeout is None:
        return httpx.AsyncClient(headers=headers)
    return httpx.AsyncClient(headers=headers, timeout=args.timeout or None)


async def burst(
    client: httpx.AsyncClient,
    url: str,
    run_id: str,
    args: argparse.Namespace,
    observer: PoolObserver,
) -> list[Outcome]:
    gate = asyncio.Semaphore(args.concurrency)
    tag = uuid.uuid4().hex[:8]

    async def one(i: int) -> Outcome:
        async with gate:
            if i % 3 == 0:
                body = {"name": f"burst/{tag}-{i}", "kind": "http", "spec": {"url": "http://a"}}
                return await observer.send(
                    client, "POST /v1/envs", "POST", f"{url}/v1/envs", json=body
                )
            if i % 3 == 1:
                return await observer.send(client, "GET /v1/envs", "GET", f"{url}/v1/envs")
            return await observer.send(
                client, "GET /v1/runs/{id}", "GET", f"{url}/v1/runs/{run_id}"
            )

    if not args.waves:
        return list(await asyncio.gather(*(one(i) for i in range(args.requests))))
    outcomes: list[Outcome] = []
    for start in range(0, args.requests, args.concurrency):
        stop = min(args.requests, start + args.concurrency)
        outcomes += await asyncio.gather(*(one(i) for i in range(start, stop)))
    return outcomes


async def edge_client(
    url: str,
    headers: dict[str, str],
    args: argparse.Namespace,
    observer: PoolObserver,
    burst_done: threading.Event,
    seed: int,
) -> list[Outcome]:
    """One stock client sending again on its pooled connection 1 to 15 ms before httpx
    expires it, until the burst is over (at least once)."""
    rnd = random.Random(seed)
    outcomes: list[Outcome] = []
    async with make_client(headers, args) as client:
        await observer.send(client, "GET /v1/envs", "GET", f"{url}/v1/envs")
        while True:
            # The pool's expiry clock started when the response was closed, just before.
            edge = time.monotonic() + KEEPALIVE_EXPIRY_S - rnd.uniform(0.001, 0.015)
            await asyncio.sleep(max(0.0, edge - time.monotonic()))
            outcomes.append(await observer.send(client, EDGE_ROUTE, "GET", f"{url}/v1/envs"))
            if burst_done.is_set():
                return outcomes


def edge_clients(
    url: str,
    headers: dict[str, str],
    args: argparse.Namespace,
    observer: PoolObserver,
    burst_done: threading.Event,
    into: list[Outcome],
) -> threading.Thread:
    """`--edge` clients on a thread of their own: on the burst's event loop, busy with
    200 requests, their sleeps would overshoot the few milliseconds they aim at."""

    async def clients() -> None:
        done = await asyncio.gather(
            *(edge_client(url, headers, args, observer, burst_done, s) for s in range(args.edge))
        )
        into.extend(o for outcomes in done for o in outcomes)

    thread = threading.Thread(target=asyncio.run, args=(clients(),), daemon=True)
    thread.start()
    return thread


async def one_run(
    gw: Gateway,
    headers: dict[str, str],
    run_id: str,
    args: argparse.Namespace,
    observer: PoolObserver,
) -> tuple[list[Outcome], list[Outcome]]:
    burst_done = threading.Event()
    edge_outcomes: list[Outcome] = []
    edges = None
    if args.edge:
        edges = edge_clients(gw.url, headers, args, observer, burst_done, edge_outcomes)
    async with make_client(headers, args) as client:
        outcomes = await burst(client, gw.url, run_id, args, observer)
    burst_done.set()
    if edges is not None:
        await asyncio.to_thread(edges.join)
    return outcomes, edge_outcomes


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else 0.0


def _summary(outcomes: list[Outcome]) -> str:
    errors = Counter(o.error for o in outcomes if o.error is not None)
    statuses = Counter(o.status for o in outcomes if o.status is not None)
    latencies = [o.latency_s for o in outcomes]
    reused = sum(1 for o in outcomes if o.reused)
    return (
        f"{len(outcomes)} requests; transport errors {sum(errors.values())}"
        f"{' ' + str(dict(errors)) if errors else ''};"
        f" statuses {dict(sorted(statuses.items()))};"
        f" latency p50 {_ms(latencies, 0.5):.0f} ms p99 {_ms(latencies, 0.99):.0f} ms"
        f" max {_ms(latencies, 1.0):.0f} ms; {reused} on a reused connection"
    )


def report(
    label: str,
    outcomes: list[Outcome],
    edge_outcomes: list[Outcome],
    counters: dict[str, int],
    wall_s: float,
    sockets: SocketSampler,
    gw: Gateway,
) -> int:
    print(f"{label} ({wall_s:.1f} s): burst: {_summary(outcomes)}")
    if edge_outcomes:
        print(f"  keep-alive edge: {_summary(edge_outcomes)}")
    idles = sorted(o.idle_s for o in outcomes if o.reused and o.idle_s is not None)
    if idles:
        print(
            f"  burst requests on reused connections: idle before them median"
            f" {statistics.median(idles):.3f} s, max {idles[-1]:.3f} s"
        )
    print(f"  most at once on the gateway's port: {sockets.summary()}")
    moved = {k: v for k, v in counters.items() if v}
    if moved:
        print(f"  TCP counters moved (whole namespace): {moved}")
    failed = [o for o in outcomes + edge_outcomes if o.error is not None]
    # Timeouts are a loaded machine's (a stock client waits 5 s at most): counted above,
    # not listed; every other transport error is listed with its connection's history.
    for o in failed:
        if "Timeout" in (o.error or ""):
            continue
        what = f"  {o.route}: {o.error} ({o.cause}) after {o.latency_s * 1e3:.0f} ms;"
        if o.number is None:  # it failed before it had a connection
            print(f"{what} no connection")
            continue
        idle = "-" if o.idle_s is None else f"{o.idle_s:.3f} s"
        print(
            f"{what} connection {'reused' if o.reused else 'new'} (request #{o.number} on"
            f" it, idle {idle} before it, opened {o.age_s or 0:.3f} s before it, local"
            f" port {o.port})"
        )
        for line in gw.lines_about(o):
            print(f"    gateway: {line}")
    return len(failed)


async def bench_gateway(
    gw: Gateway, headers: dict[str, str], args: argparse.Namespace
) -> list[int]:
    run_id = await asyncio.to_thread(setup, gw.url, headers)
    observer = PoolObserver()
    errors = []
    with observer.installed():
        for n in range(1, args.runs + 1):
            before = nstat()
            started = time.perf_counter()
            with SocketSampler(gw.port, gw.pid).sampling() as sockets:
                outcomes, edge_outcomes = await one_run(gw, headers, run_id, args, observer)
            wall = time.perf_counter() - started
            after = nstat()
            moved = {k: after[k] - before.get(k, 0) for k in after}
            errors.append(report(f"run {n}", outcomes, edge_outcomes, moved, wall, sockets, gw))
    return errors


def run_on(db: str, args: argparse.Namespace) -> list[int]:
    api_key = secrets.token_hex(16)
    headers = {"Authorization": f"Bearer {api_key}"}
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="burst")))
        if db == "postgresql":
            database_url = stack.enter_context(
                scratch_database(args.pg_url, prefix="agentflow_burst")
            )
        else:
            database_url = f"sqlite+aiosqlite:///{scratch / 'agentflow.db'}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTFLOW_")}
            env |= {"AGENTFLOW_DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
            upgrade = [*AGENTFLOW, "db", "upgrade"]
            subprocess.run(upgrade, env=env, cwd=scratch, check=True, stdout=subprocess.DEVNULL)
        log_path = scratch / "gateway.log"
        try:
            with gateway(database_url, api_key, log_path, traced=args.trace_server) as gw:
                print(f"{db}: gateway pid {gw.pid} at {gw.url}")
                return asyncio.run(bench_gateway(gw, headers, args))
        finally:
            if args.show_log:
                print(f"--- gateway log ({db}) ---")
                print(log_path.read_text(errors="replace"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument(
        "--waves",
        action="store_true",
        help="send --concurrency requests, wait for all their answers, then the next ones "
        "(default: the next request as soon as one is answered)",
    )
    parser.add_argument(
        "--edge",
        type=int,
        default=0,
        help="stock clients reusing their pooled connection just before httpx expires it",
    )
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="postgresql")
    parser.add_argument("--pg-url", default=DEFAULT_ADMIN_URL)
    parser.add_argument(
        "--timeout", type=float, help="the clients' timeout (default httpx's 5 s; 0: none)"
    )
    parser.add_argument(
        "--trace-server",
        action="store_true",
        help="run the gateway with uvicorn's TRACE log and show its lines for each failure",
    )
    parser.add_argument("--show-log", action="store_true", help="print the gateway's log")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    per_run: list[int] = []
    for db in ("sqlite", "postgresql") if args.db == "both" else (args.db,):
        errors = run_on(db, args)
        print(f"{db}: transport errors per run {errors}")
        per_run += errors
    print(f"{sum(per_run)} transport errors in {len(per_run)} runs")
    sys.exit(1 if sum(per_run) else 0)


if __name__ == "__main__":
    main()
