"""`LatencyModelEngine`: an `Engine` that simulates a serving engine's timing, not its model.

Benchmarks and tests of the rollout side need an engine whose *time* behaves like a real
one (long-tailed response lengths, a decode step that slows as the batch grows, a batch
cap that makes requests queue, weight updates that stall decoding) without the cost of a
model. This engine batches continuously on the wall clock: a background task runs decode
steps of `step_base_s + step_per_seq_s * batch` seconds (the first step after requests
join also pays `prefill_s_per_token` per uncached context token), and every running
request gets one token per step. Every duration is multiplied by `time_scale`, so tests
run the same schedule hundreds of times faster.

Protocol behaviour mirrors `LocalEngine`: sessions keep each request's context (and
report its prefix as `cached_tokens` unless a weight update flushed it), pause and abort
land between two steps, `pause(abort)` ends running and waiting requests with their
partial output, `pause(retract)` sends running requests back to the queue (their context
is prefilled again on resume), `pause(in_place)` holds them, and every output token is
tagged with the weight version current when it was produced.

What a request produces is fixed when it is first admitted: a target length drawn from a
lognormal distribution (median `length_median`, shape `length_sigma`, clipped to
`[length_min, length_max]`) and that many tokens: random lowercase letters and spaces
(byte-tokenizer ids), the last one the request's first stop token. The draw is seeded by
`(seed, sampling.seed)`, or `(seed, rid)` when the request has no seed, so a run with
fixed rids is reproducible. The request finishes with `stop` when the planned tokens run
out, or with `length` when `max_new_tokens` (or the context length) comes first.

Partial rollouts: when a request ends with `abort`, the tokens it had yet to produce are
remembered under its full context (prompt + partial output). A later request whose full
context is exactly that, however it is built (the same rid resubmitted with
`input_ids + partial output`, as `SGLangEngine` does, or a new rid on a re-opened
session), *continues* the interrupted turn: it produces the remaining tokens, so the turn
ends at its original target length instead of drawing a new one. Restarting from scratch
(the original context without the partial output) draws afresh. The memory of
interrupted turns is bounded (`max_interrupted`, oldest forgotten first).

`info().extra` measures the engine: `busy_fraction` (time spent decoding at least one
request, over the wall time since start or `reset_stats()`), `tokens_decoded`,
`decode_steps`, `mean_batch` (tokens per decode step) and `prefill_tokens`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentflow.errors import EngineRequestError, EngineUnavailable, NotFound
from agentflow.inference.base import (
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    VersionSpan,
    WeightUpdate,
    next_weight_version,
)

# Lowercase letters and spaces: valid byte-tokenizer ids that never spell a chat marker.
_ALPHABET = tuple(b"abcdefghijklmnopqrstuvwxyz     ")


class LatencyModelConfig(BaseModel):
    """The simulated engine's timing and output distribution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(default=0, description="seeds every request's draw (with its rid/seed)")
    max_batch_size: int = Field(default=64, ge=1, description="requests decoded at once")
    step_base_s: float = Field(default=0.01, ge=0.0, description="fixed cost of a decode step")
    step_per_seq_s: float = Field(
        default=0.0002, ge=0.0, description="added to a decode step per running request"
    )
    prefill_s_per_token: float = Field(
        default=0.00001, ge=0.0, description="prefill cost per uncached context token"
    )
    update_s: float = Field(default=0.0, ge=0.0, description="time a weight update stalls")
    time_scale: float = Field(default=1.0, gt=0.0, description="multiplies every duration")
    length_median: float = Field(default=64.0, gt=0.0, description="median response tokens")
    length_sigma: float = Field(default=1.0, ge=0.0, description="lognormal shape: the tail")
    length_min: int = Field(default=1, ge=1, description="shortest response (tokens)")
    length_max: int = Field(default=2048, ge=1, description="longest response (tokens)")
    max_context: int = Field(default=32768, ge=2, description="context length in tokens")
    vocab_size: int = Field(default=266, ge=32, description="input ids must be below this")
    max_interrupted: int = Field(
        default=65536, ge=0, description="aborted turns remembered for continuation"
    )

    @model_validator(mode="after")
    def _bounds(self) -> LatencyModelConfig:
        if self.length_min > self.length_max:
            raise ValueError("length_min must be <= length_max")
        return self

    def step_s(self, batch: int) -> float:
        """Wall seconds of one decode step of `batch` requests."""
        return (self.step_base_s + self.step_per_seq_s * batch) * self.time_scale


@dataclass(eq=False)
class _Live:
    """One request from submission to result."""

    req: GenerateRequest
    future: asyncio.Future[GenerateResult]
    context: list[int]  # session prefix + input + output so far
    prompt_len: int
    session_id: str | None
    plan: list[int]  # every token this turn will produce, from its first token on
    plan_logprobs: list[float]
    limit: int  # output tokens this request may produce (max_new_tokens, context room)
    cached_tokens: int = 0
    kv_len: int = 0  # context tokens whose KV is held; 0 after a retract
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)  # [version, start, end]
    done: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid

    def left(self) -> int:
        """Tokens until this request finishes (stop or length)."""
        return min(len(self.plan), self.limit) - len(self.output)

    def emit(self, n: int, version: int) -> None:
        start = len(self.output)
        self.output += self.plan[start : start + n]
        self.logprobs += self.plan_logprobs[start : start + n]
        self.context += self.plan[start : start + n]
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = start + n
        else:
            self.spans.append([version, start, start + n])


@dataclass
class _Stored:
    context: list[int]
    kv_valid: bool  # False once a weight update flushed it: a child prefills it again


@dataclass
class _Interrupted:
    plan: list[int]  # tokens the aborted turn had yet to produce
    logprobs: list[float]


@dataclass
class _Burst:
    """Decode steps of a fixed batch, run back to back until the first request finishes."""

    batch: int
    first_s: float  # the first step also prefills the requests that joined
    step_s: float
    max_steps: int
    clock_started: float = field(default_factory=time.perf_counter)

    def duration(self, steps: int) -> float:
        return self.first_s + (steps - 1) * self.step_s

    def steps_done(self, elapsed: float) -> int:
        if elapsed < self.first_s:
            return 0
        whole = 1 + int((elapsed - self.first_s) / self.step_s) if self.step_s > 0 else 1
        return min(self.max_steps, whole)

    def steps_started(self, elapsed: float) -> int:
        if elapsed <= self.first_s or self.step_s <= 0:
            return 1
        return min(self.max_steps, 1 + math.ceil((elapsed - self.first_s) / self.step_s))


@dataclass
class EngineStats:
    """Decode accounting since `started` (engine start or `reset_stats()`)."""

    started: float = field(default_factory=time.perf_counter)
    busy_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    prefill_tokens: int = 0


class LatencyModelEngine:
    """A timing model of a continuously batching engine; see the module docstring."""

    def __init__(self, config: LatencyModelConfig | None = None, *, weight_version: int = 0):
        self.config = config or LatencyModelConfig()
        self.weight_version = weight_version
        self.stats = EngineStats()
        self._running: list[_Live] = []
        self._waiting: deque[_Live] = deque()
        self._by_rid: dict[str, _Live] = {}
        self._sessions: dict[str, dict[str, _Stored]] = {}
        self._interrupted: OrderedDict[tuple[int, ...], _Interrupted] = OrderedDict()
        self._paused: PauseMode | None = None
        self._closed = False
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None  # there may be work
        self._interrupt: asyncio.Event | None = None  # end the current burst of steps
        self._task: asyncio.Task[None] | None = None
        self._burst_now: _Burst | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if self._task is not None and self._task.get_loop() is not asyncio.get_running_loop():
            raise EngineUnavailable("the engine serves another event loop; make one per loop")
        if self._task is None:
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._interrupt = asyncio.Event()
            self.stats = EngineStats()
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            assert self._lock is not None and self._wake is not None
            self._interrupt_burst()
            async with self._lock:
                for r in [*self._running, *self._waiting]:
                    self._finish(r, "abort")
            self._wake.set()
            await self._task

    def reset_stats(self) -> None:
        """Measure from now on (e.g. after a warm-up)."""
        self.stats = EngineStats()

    # -- requests -----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        await self.start()
        assert self._wake is not None and self._interrupt is not None
        r = self._admit(req)
        self._by_rid[req.rid] = r
        self._waiting.append(r)
        if self._paused is None and len(self._running) < self.config.max_batch_size:
            self._interrupt.set()  # a free slot: join at the next step, not after the burst
        self._wake.set()
        try:
            return await asyncio.shield(r.future)
        except asyncio.CancelledError:
            await self.abort(req.rid)  # the caller gave up: free its slot
            raise

    def _admit(self, req: GenerateRequest) -> _Live:
        """Validate `req`, build its context and fix what it will produce."""
        cfg = self.config
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if not req.input_ids:
            raise EngineRequestError("input_ids is empty")
        bad = [t for t in req.input_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise EngineRequestError(
                f"input_ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}"
            )
        if req.rid in self._by_rid:
            raise EngineRequestError(f"rid {req.rid!r} is already running")
        prefix: list[int] = []
        cached = 0
        session_id = None
        if req.session is not None:
            session_id = req.session.session_id
            session = self._sessions.get(session_id)
            if session is None:
                raise EngineRequestError(f"unknown session {session_id!r}")
            if req.session.parent_rid is not None:
                parent = session.get(req.session.parent_rid)
                if parent is None:
                    raise EngineRequestError(
                        f"unknown parent rid {req.session.parent_rid!r} in session {session_id!r}"
                    )
                offset = req.session.offset
                if offset is not None and offset > len(parent.context):
                    raise EngineRequestError(
                        f"offset {offset} is past the parent's context "
                        f"({len(parent.context)} tokens)"
                    )
                prefix = parent.context[:offset] if offset is not None else list(parent.context)
                cached = len(prefix) if parent.kv_valid else 0
        context = prefix + list(req.input_ids)
        sp = req.sampling
        if len(context) + sp.max_new_tokens > cfg.max_context:
            raise EngineRequestError(
                f"context ({len(context)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                f"exceeds the context length {cfg.max_context}"
            )
        interrupted = self._interrupted.pop(tuple(context), None)
        if interrupted is not None:
            plan, logprobs = interrupted.plan, interrupted.logprobs
        else:
            plan, logprobs = self._draw(req)
        return _Live(
            req=req,
            future=asyncio.get_running_loop().create_future(),
            context=context,
            prompt_len=len(context),
            session_id=session_id,
            plan=plan,
            plan_logprobs=logprobs,
            limit=sp.max_new_tokens,
            cached_tokens=cached,
            kv_len=cached,
        )

    def draw_length(self, key: str) -> int:
        """The target response length of the request keyed `key` (its rid or seed)."""
        return self._target(random.Random(f"{self.config.seed}:{key}"))

    def _target(self, rng: random.Random) -> int:
        cfg = self.config
        drawn = rng.lognormvariate(math.log(cfg.length_median), cfg.length_sigma)
        return max(cfg.length_min, min(cfg.length_max, round(drawn)))

    def _draw(self, req: GenerateRequest) -> tuple[list[int], list[float]]:
        key = req.rid if req.sampling.seed is None else f"seed={req.sampling.seed}"
        rng = random.Random(f"{self.config.seed}:{key}")
        n = self._target(rng)
        stops = req.sampling.stop_token_ids
        body = n - 1 if stops else n
        tokens = [rng.choice(_ALPHABET) for _ in range(body)]
        if stops:
            tokens.append(stops[0])
        logprobs = [-rng.expovariate(2.0) for _ in tokens]
        return tokens, logprobs

    async def abort(self, rid: str) -> None:
        r = self._by_rid.get(rid)
        if r is None or self._lock is None:
            return
        self._interrupt_burst()
        async with self._lock:
            if not r.done:
                self._finish(r, "abort")

    # -- sessions -----------------------------------------------------------------------

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise EngineRequestError(f"session {sid!r} is already open")
        self._sessions[sid] = {}
        return sid

    async def close_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise NotFound(f"unknown session {session_id!r}")

    # -- pause / weights ----------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        await self.start()
        assert self._lock is not None
        self._interrupt_burst()
        async with self._lock:
            self._paused = mode
            if mode is PauseMode.ABORT:
                for r in [*self._running, *self._waiting]:
                    self._finish(r, "abort")
            elif mode is PauseMode.RETRACT:
                for r in self._running:
                    r.kv_len = 0  # recomputed (under the new weights) when it joins again
                self._waiting.extendleft(reversed(self._running))
                self._running = []

    async def resume(self) -> None:
        await self.start()
        assert self._lock is not None and self._wake is not None
        async with self._lock:
            self._paused = None
        self._wake.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        await self.start()
        assert self._lock is not None
        version = next_weight_version(self.weight_version, update)
        self._interrupt_burst()
        async with self._lock:  # no decode step runs while the weights change
            if self.config.update_s:
                await asyncio.sleep(self.config.update_s * self.config.time_scale)
            self.weight_version = version
            if self._paused is not PauseMode.IN_PLACE:
                for session in self._sessions.values():  # stored KV came from old weights
                    for stored in session.values():
                        stored.kv_valid = False
        return version

    async def accepts_images(self) -> bool:
        return False  # a model of a text engine's timing

    async def info(self) -> EngineInfo:
        cfg, stats = self.config, self.stats
        now = time.perf_counter()
        wall = max(now - stats.started, 1e-9)
        busy_s, tokens, steps = stats.busy_s, stats.tokens, stats.steps
        burst = self._burst_now
        if burst is not None:  # count the burst under way up to its last whole step
            busy_s += now - max(burst.clock_started, stats.started)
            done = burst.steps_done(now - burst.clock_started)
            tokens, steps = tokens + done * burst.batch, steps + done
        return EngineInfo(
            model="latency-model",
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_context,
            weight_version=self.weight_version,
            running=len(self._running),
            waiting=len(self._waiting),
            paused=self._paused is not None,
            sessions=len(self._sessions),
            kv_tokens=sum(
                len(s.context) for ss in self._sessions.values() for s in ss.values() if s.kv_valid
            ),
            extra={
                "max_batch_size": cfg.max_batch_size,
                "busy_fraction": min(1.0, busy_s / wall),
                "busy_s": busy_s,
                "wall_s": wall,
                "tokens_decoded": tokens,
                "decode_steps": steps,
                "mean_batch": tokens / steps if steps else 0.0,
                "prefill_tokens": stats.prefill_tokens,
                "interrupted_turns": len(self._interrupted),
            },
        )

    # -- the serving loop ---------------------------------------------------------------

    def _interrupt_burst(self) -> None:
        if self._interrupt is not None:
            self._interrupt.set()

    async def _serve(self) -> None:
        assert self._lock is not None and self._wake is not None
        while not self._closed:
            await self._wake.wait()
            async with self._lock:
                if self._closed:
                    break
                if self._paused is not None or not (self._running or self._waiting):
                    self._wake.clear()
                    continue
                await self._burst()
            await asyncio.sleep(0)  # let pause/abort/update take the lock between bursts

    async def _burst(self) -> None:
        """Join waiting requests, then decode until the first finish or an interrupt."""
        assert self._interrupt is not None
        cfg = self.config
        self._interrupt.clear()
        prefill = 0
        while self._waiting and len(self._running) < cfg.max_batch_size:
            r = self._waiting.popleft()
            prefill += len(r.context) - r.kv_len
            r.kv_len = len(r.context)
            self._running.append(r)
        step = cfg.step_s(len(self._running))
        burst = _Burst(
            batch=len(self._running),
            first_s=step + cfg.prefill_s_per_token * prefill * cfg.time_scale,
            step_s=step,
            max_steps=min(r.left() for r in self._running),
        )
        self._burst_now = burst
        try:
            await asyncio.wait_for(self._interrupt.wait(), burst.duration(burst.max_steps))
            # Interrupted: the step under way completes; the rest of the burst does not.
            steps = burst.steps_started(time.perf_counter() - burst.clock_started)
            remaining = burst.clock_started + burst.duration(steps) - time.perf_counter()
            if remaining > 0:
                await asyncio.sleep(remaining)
        except TimeoutError:
            steps = burst.max_steps
        finally:
            self._burst_now = None
        stats = self.stats  # a reset during the burst counts only its part after the reset
        stats.busy_s += time.perf_counter() - max(burst.clock_started, stats.started)
        stats.tokens += steps * burst.batch
        stats.steps += steps
        stats.prefill_tokens += prefill
        for r in list(self._running):
            r.emit(steps, self.weight_version)
            r.kv_len = len(r.context)
            if r.left() <= 0:
                self._finish(r, "stop" if len(r.output) >= len(r.plan) else "length")

    def _finish(self, r: _Live, reason: FinishReason) -> None:
        """End `r`: resolve its future; keep its context if it is in a session."""
        if r.done:
            return
        r.done = True
        self._by_rid.pop(r.rid, None)
        if r in self._waiting:
            self._waiting.remove(r)
        if r in self._running:
            self._running.remove(r)
        session = self._sessions.get(r.session_id) if r.session_id else None
        if session is not None:
            session[r.rid] = _Stored(list(r.context), kv_valid=r.kv_len > 0)
        if reason == "abort" and len(r.output) < len(r.plan) and self.config.max_interrupted:
            produced = len(r.output)
            self._interrupted[tuple(r.context)] = _Interrupted(
                r.plan[produced:], r.plan_logprobs[produced:]
            )
            while len(self._interrupted) > self.config.max_interrupted:
                self._interrupted.popitem(last=False)
        if not r.future.done():
            r.future.set_result(
                GenerateResult(
                    rid=r.rid,
                    output_ids=list(r.output),
                    logprobs=list(r.logprobs),
                    finish_reason=reason,
                    weight_versions=[VersionSpan(version=v, start=s, end=e) for v, s, e in r.spans],
                    prompt_tokens=r.prompt_len,
                    cached_tokens=r.cached_tokens,
                )
            )
