"""SGLangEngine through the real sglang-router (0.3.2) to mock SGLang workers on LocalEngine.

One router subprocess serves the module (its start-up dominates); the workers are real
uvicorn servers on loopback ports, run in threads so torch is imported once. The router
runs with `--policy manual` (sticky by `x-smg-routing-key`; a new key goes to a worker
the router picks) and with its own retries and circuit breaker off: after a few 5xx the
breaker moves a key to another worker, which would break a session, and the client
already retries.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentflow.inference.base import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.inference.sglang_router import RouterWorkers
from tests.support.mock_sglang import WorkerState, create_mock_worker

pytestmark = pytest.mark.integration

INIT = {"layers": 2, "hidden": 64, "heads": 4, "max_context": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadWorker:
    """A mock SGLang worker (LocalEngine) served by uvicorn in its own thread and loop."""

    def __init__(self, model_dir: Path) -> None:
        import uvicorn

        from agentflow.inference.local import LocalEngine

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = LocalEngine.from_pretrained(model_dir, max_batch_size=8)
        self.app = create_mock_worker(self.engine, model_path=str(model_dir), close_engine=True)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),))
        self.thread.start()

    @property
    def state(self) -> WorkerState:
        return self.app.state.worker

    def rids(self) -> set[str]:
        return {entry["rid"] for entry in self.state.log}

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"worker on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class Cluster:
    router_url: str
    workers: list[ThreadWorker]
    spare: ThreadWorker  # not behind the router until a test adds it
    v0_dir: Path
    v1_dir: Path
    timings: dict[str, float]

    def owner(self, rid: str) -> list[ThreadWorker]:
        return [w for w in [*self.workers, self.spare] if rid in w.rids()]


def _start_router(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(port),
                "--policy", "manual",
                "--disable-retries", "--disable-circuit-breaker",
                "--log-level", "warn",
                # Its metrics exporter binds a fixed port by default: two routers collide.
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def _wait_router(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/workers", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"router did not answer: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("sglang-router")
    timings: dict[str, float] = {}
    # The router starts with no workers, while the models load; they join through
    # POST /workers, the same run-time API the add/remove test uses.
    port, log = free_port(), tmp / "router.log"
    started = time.monotonic()
    proc = _start_router(port, log)
    url = f"http://127.0.0.1:{port}"
    workers: list[ThreadWorker] = []
    try:
        from agentflow.modeling import ModelInit, build_model, save_model

        init = ModelInit.model_validate(INIT)
        v0_dir = save_model(build_model(init, seed=0), tmp / "v0")
        v1_dir = save_model(build_model(init, seed=1), tmp / "v1")
        workers = [ThreadWorker(v0_dir) for _ in range(3)]
        for w in workers:
            w.wait_ready()
        _wait_router(url, proc, log)
        timings["router_up_after_s"] = time.monotonic() - started

        async def join() -> None:
            admin = RouterWorkers(url)
            try:
                for w in workers[:2]:
                    await admin.add(w.url)
            finally:
                await admin.close()

        begin = time.monotonic()
        asyncio.run(join())
        timings["two_workers_registered_s"] = time.monotonic() - begin
        yield Cluster(url, workers[:2], workers[2], v0_dir, v1_dir, timings)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for w in workers:
            w.stop()
        print(f"\nsglang-router timings: {timings}")


@pytest.fixture
async def engine(cluster: Cluster) -> AsyncIterator[SGLangEngine]:
    eng = SGLangEngine(
        SGLangSettings(url=cluster.router_url, behind_router=True, resubmit_aborted=True)
    )
    yield eng
    await eng.close()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


async def test_same_key_same_worker(cluster: Cluster, engine: SGLangEngine) -> None:
    keys = [f"key-{i}" for i in range(16)]
    reqs = [
        GenerateRequest(input_ids=(1, 2, 3 + i), sampling=greedy(3), rid=f"{k}-r{i}", routing_key=k)
        for k in keys
        for i in range(2)
    ]
    results = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert all(len(r.output_ids) == 3 for r in results)

    placement: dict[str, set[int]] = {}
    for req in reqs:
        (owner,) = cluster.owner(req.rid)
        placement.setdefault(req.routing_key or "", set()).add(cluster.workers.index(owner))
    assert all(len(where) == 1 for where in placement.values()), placement
    # 16 keys all on one of two workers would be a routing bug (or a 2**-15 chance).
    assert {next(iter(where)) for where in placement.values()} == {0, 1}, "keys did not spread"


async def test_session_follows_its_key(cluster: Cluster, engine: SGLangEngine) -> None:
    sid = await engine.open_session()
    first = await engine.generate(
        GenerateRequest(
            input_ids=(5, 6, 7),
            sampling=greedy(4),
            rid=f"{sid}-1",
            session=SessionRef(session_id=sid),
            routing_key=sid,
        )
    )
    # A parent rid exists on one worker only: this succeeds only if routing stayed sticky.
    second = await engine.generate(
        GenerateRequest(
            input_ids=(8,),
            sampling=greedy(4),
            rid=f"{sid}-2",
            session=SessionRef(session_id=sid, parent_rid=f"{sid}-1"),
            routing_key=sid,
        )
    )
    assert second.prompt_tokens == 3 + 4 + 1
    assert second.cached_tokens > 0
    stateless = await engine.generate(
        GenerateRequest(input_ids=(5, 6, 7, *first.output_ids, 8), sampling=greedy(4))
    )
    assert second.output_ids == stateless.output_ids
    assert cluster.owner(f"{sid}-1") == cluster.owner(f"{sid}-2")
    await engine.close_session(sid)


async def test_worker_added_and_removed_at_run_time(cluster: Cluster, engine: SGLangEngine) -> None:
    admin = RouterWorkers(cluster.router_url)
    try:
        started = time.monotonic()
        worker_id = await admin.add(cluster.spare.url)
        cluster.timings["worker_add_s"] = time.monotonic() - started
        assert cluster.spare.url in await engine.worker_urls()

        # The router places new keys (randomly by default): open keys until one lands
        # on the new worker.
        on_spare: list[str] = []
        for i in range(60):
            key = f"fresh-{i}"
            await engine.generate(
                GenerateRequest(input_ids=(4,), sampling=greedy(2), rid=f"{key}-a", routing_key=key)
            )
            if cluster.owner(f"{key}-a") == [cluster.spare]:
                on_spare.append(key)
                break
        assert on_spare, "no request reached the added worker"

        started = time.monotonic()
        await admin.remove(worker_id)
        cluster.timings["worker_remove_s"] = time.monotonic() - started
        assert cluster.spare.url not in await engine.worker_urls()
        before = len(cluster.spare.state.log)
        for k in on_spare:
            result = await engine.generate(
                GenerateRequest(input_ids=(4,), sampling=greedy(2), rid=f"{k}-b", routing_key=k)
            )
            assert len(result.output_ids) == 2
            assert cluster.owner(f"{k}-b")[0] in cluster.workers
        assert len(cluster.spare.state.log) == before
    finally:
        await admin.close()


async def _running_on(url: str, rid: str) -> bool:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{url}/mock/state")).json()
    return rid in state["in_flight"] and state["engine"]["running"] > 0


async def test_pause_abort_resubmits_and_stitches(cluster: Cluster, engine: SGLangEngine) -> None:
    from agentflow.modeling import load_model, score

    prompt = (10, 20, 30, 40)
    n = 300
    reference = await engine.generate(
        GenerateRequest(input_ids=prompt, sampling=greedy(n), routing_key="partial")
    )
    assert reference.finish_reason == "length"
    (owner,) = cluster.owner(reference.rid)

    result, base = None, 0
    for attempt in range(3):  # the pause must land mid-generation; retry if it missed
        rid = f"partial-{attempt}"
        base = await engine.current_version()
        task = asyncio.create_task(
            engine.generate(
                GenerateRequest(
                    input_ids=prompt, sampling=greedy(n), rid=rid, routing_key="partial"
                )
            )
        )
        while not task.done() and not await _running_on(owner.url, rid):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # let it produce some tokens
        await engine.pause(PauseMode.ABORT)
        assert await engine.update_weights(WeightUpdate(path=str(cluster.v1_dir))) == base + 1
        await engine.resume()
        result = await task
        if len([e for e in owner.state.log if e["rid"] == rid]) == 2:
            break
        await engine.update_weights(WeightUpdate(path=str(cluster.v0_dir)))
    assert result is not None

    first, second = [e for e in owner.state.log if e["rid"] == result.rid]
    k = len(second["input_ids"]) - len(prompt)
    cluster.timings["partial_tokens_at_pause"] = k
    assert 0 < k < n
    # Not restarted: the first k tokens are the uninterrupted v0 run's, and the continuation
    # was asked for exactly the rest, from prompt + those tokens.
    assert result.output_ids[:k] == reference.output_ids[:k]
    assert second["input_ids"] == [*prompt, *reference.output_ids[:k]]
    assert second["max_new_tokens"] == n - k
    assert len(result.output_ids) == n and result.finish_reason == "length"
    spans = [(s.version, s.start, s.end) for s in result.weight_versions]
    assert spans == [(base, 0, k), (base + 1, k, n)]
    # Tokens after the switch score as the new weights, tokens before as the old ones.
    full = [*prompt, *result.output_ids]
    v0 = score(load_model(cluster.v0_dir), full, 0.0, start=len(prompt))
    v1 = score(load_model(cluster.v1_dir), full, 0.0, start=len(prompt))
    assert max(abs(a - b) for a, b in zip(result.logprobs[:k], v0[:k], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(result.logprobs[k:], v1[k:], strict=True)) < 1e-4
    await engine.update_weights(WeightUpdate(path=str(cluster.v0_dir)))


async def test_router_drops_what_sglang_would_refuse(cluster: Cluster) -> None:
    """Surprise kept as a test: the router strips unknown sampling keys before the worker
    can refuse them, so strictness is visible only when talking to a worker directly."""
    body: dict[str, Any] = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 2, "not_a_key": 1},
    }
    async with httpx.AsyncClient() as client:
        via_router = await client.post(f"{cluster.router_url}/generate", json=body)
        direct = await client.post(f"{cluster.workers[0].url}/generate", json=body)
        control = await client.post(f"{cluster.router_url}/pause_generation", json={})
    assert via_router.status_code == 200
    assert direct.status_code == 400 and "not_a_key" in direct.text
    assert control.status_code == 404
