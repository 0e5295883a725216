"""What `bench/scale.py` simulates around the real controller: inference engines and an env.

Both model *time* only, as cheaply as possible, because they share the controller's
process and event loop: every CPU cycle they spend is charged to the controller.

- `SimEngine` (the `Engine` protocol): each request waits for one of `slots` batch slots,
  then `prefill_s + prefill_s_per_token * uncached + per_token_s * new_tokens` on a
  single timer (no decode loop). Replies are byte-tokenizer letters and spaces ending
  with the request's first stop token, with log-probs and weight-version spans: a weight
  update that lands while a request decodes splits its tokens at the update's time.
  `pause(abort)` and `abort(rid)` end requests with the tokens produced so far;
  `pause(retract | in_place)` holds replies until `resume`.
- `SimEnv` (`bench/scale-sim-v0`): an episode lasts a seeded number of turns, each step
  sleeps a lognormal latency, and the last step pays 0 or 1 (seeded by the task and the
  reply, so the samples of one group differ).

`EngineStats` and `ENV_STATS` add up the modeled seconds, so the benchmark can say what
turn rate the workload would reach if the controller cost nothing.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentflow.errors import EngineRequestError, EngineUnavailable, NotFound
from agentflow.ids import new_hex
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
from envs import registry
from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TurnEnv

ENV_ID = "bench/scale-sim-v0"
# Lowercase letters and spaces: byte-tokenizer ids that never spell a chat marker.
_ALPHABET = tuple(b"abcdefghijklmnopqrstuvwxyz     ")
_POOL = 1 << 16  # pre-drawn reply tokens, sliced per request (drawing them costs CPU)


@dataclass(frozen=True)
class EngineModel:
    """One simulated engine's timing and reply lengths."""

    slots: int = 128  # requests decoded at once; more wait for a slot
    prefill_s: float = 0.02  # per request
    prefill_s_per_token: float = 0.00002  # per context token not in the session's cache
    per_token_s: float = 0.02  # decode time of one output token of one request
    length_median: float = 48.0
    length_sigma: float = 0.6
    length_max: int = 512
    update_s: float = 0.0  # a weight switch holds replies this long
    max_context: int = 32768
    vocab_size: int = 266


@dataclass
class EngineStats:
    requests: int = 0
    tokens: int = 0
    modeled_s: float = 0.0  # prefill + decode time the model charged, waits for slots aside
    aborted: int = 0


@dataclass(eq=False)
class _Running:
    future: asyncio.Future[float | None]  # None: ran to the end; else the abort time
    handle: asyncio.TimerHandle | None
    decode_start: float


class SimEngine:
    """A timing model of one serving engine; see the module docstring."""

    def __init__(self, model: EngineModel | None = None, *, seed: int = 0) -> None:
        self.model = model or EngineModel()
        self.stats = EngineStats()
        self.version = 0
        self._updates: list[tuple[float, int]] = []  # (loop time, version it switched to)
        self._rng = random.Random(seed)
        self._tokens = [self._rng.choice(_ALPHABET) for _ in range(_POOL)]
        self._logprobs = [-self._rng.expovariate(2.0) for _ in range(_POOL)]
        self._sessions: dict[str, dict[str, int]] = {}  # session -> rid -> context length
        self._running: dict[str, _Running] = {}
        self._waiting: set[str] = set()  # rids waiting for a slot
        self._aborted: set[str] = set()  # ... and aborted meanwhile
        self._slots: asyncio.Semaphore | None = None
        self._resumed: asyncio.Event | None = None
        self._paused: PauseMode | None = None
        self._closed = False

    def _sync(self) -> tuple[asyncio.Semaphore, asyncio.Event]:
        if self._slots is None or self._resumed is None:
            self._slots = asyncio.Semaphore(self.model.slots)
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._slots, self._resumed

    # -- requests -----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if not req.input_ids:
            raise EngineRequestError("input_ids is empty")
        model = self.model
        prefix = cached = 0
        session: dict[str, int] | None = None
        if req.session is not None:
            session = self._sessions.get(req.session.session_id)
            if session is None:
                raise EngineRequestError(f"unknown session {req.session.session_id!r}")
            if req.session.parent_rid is not None:
                parent = session.get(req.session.parent_rid)
                if parent is None:
                    raise EngineRequestError(f"unknown parent rid {req.session.parent_rid!r}")
                offset = req.session.offset
                prefix = parent if offset is None else min(offset, parent)
                cached = prefix
        prompt = prefix + len(req.input_ids)
        limit = min(req.sampling.max_new_tokens, model.max_context - prompt)
        if limit < 1:
            raise EngineRequestError(f"no room after a context of {prompt} tokens")
        drawn = self._rng.lognormvariate(math.log(model.length_median), model.length_sigma)
        planned = max(1, min(model.length_max, round(drawn)))
        n = min(planned, limit)
        stops = req.sampling.stop_token_ids
        ends_with_stop = bool(stops) and n == planned
        slots, resumed = self._sync()
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        self._waiting.add(req.rid)
        acquired = False
        try:
            await slots.acquire()
            acquired = True
            if not resumed.is_set():
                await resumed.wait()
            self._waiting.discard(req.rid)
            if req.rid in self._aborted or self._closed:
                self._aborted.discard(req.rid)
                return self._result(req, [], [], "abort", prompt, cached)
            prefill = model.prefill_s + model.prefill_s_per_token * (prompt - cached)
            started = loop.time()
            decode_start = started + prefill
            future: asyncio.Future[float | None] = loop.create_future()
            handle = loop.call_later(prefill + n * model.per_token_s, _resolve, future, None)
            self._running[req.rid] = _Running(future, handle, decode_start)
            try:
                stopped_at = await future
            finally:
                del self._running[req.rid]
                handle.cancel()
            if stopped_at is None and not resumed.is_set():
                await resumed.wait()  # retracted or held in place until the switch is over
        finally:
            self._waiting.discard(req.rid)
            if acquired:
                slots.release()
        produced = n
        finish: FinishReason = "stop" if ends_with_stop or not stops else "length"
        if stopped_at is not None:
            produced = min(n, max(0, int((stopped_at - decode_start) / model.per_token_s)))
            finish = "abort"
            self.stats.aborted += 1
        ids, logprobs = self._reply(produced, ends_with_stop and finish != "abort", stops)
        spans = self._spans(decode_start, len(ids))
        self.stats.requests += 1
        self.stats.tokens += len(ids)
        self.stats.modeled_s += prefill + len(ids) * model.per_token_s
        if session is not None and finish != "abort":
            session[req.rid] = prompt + len(ids)
        return self._result(req, ids, logprobs, finish, prompt, cached, spans, started - queued_at)

    def _reply(
        self, n: int, ends_with_stop: bool, stops: tuple[int, ...]
    ) -> tuple[list[int], list[float]]:
        start = self._rng.randrange(_POOL - n) if n < _POOL else 0
        body = n - 1 if ends_with_stop else n
        ids = self._tokens[start : start + body]
        logprobs = self._logprobs[start : start + n]
        if ends_with_stop:
            ids.append(stops[0])
        return ids, logprobs

    def _spans(self, decode_start: float, n: int) -> list[VersionSpan]:
        """Token i came out at `decode_start + (i + 1) * per_token_s`, under the version
        that was current then."""
        if n == 0:
            return []
        later = []
        for at, version in reversed(self._updates):
            if at <= decode_start:
                break
            later.append((at, version))
        if not later:
            return [VersionSpan(version=self.version, start=0, end=n)]
        spans: list[VersionSpan] = []
        first = self._version_at(decode_start)
        start, current = 0, first
        for at, version in reversed(later):
            cut = min(n, max(start, int((at - decode_start) / self.model.per_token_s)))
            if cut > start:
                spans.append(VersionSpan(version=current, start=start, end=cut))
            start, current = cut, version
        if n > start:
            spans.append(VersionSpan(version=current, start=start, end=n))
        return spans

    def _version_at(self, at: float) -> int:
        version = 0
        for when, v in self._updates:
            if when > at:
                break
            version = v
        return version

    def _result(
        self,
        req: GenerateRequest,
        ids: list[int],
        logprobs: list[float],
        finish: FinishReason,
        prompt: int,
        cached: int,
        spans: list[VersionSpan] | None = None,
        queue_s: float = 0.0,
    ) -> GenerateResult:
        return GenerateResult(
            rid=req.rid,
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_versions=spans or [],
            prompt_tokens=prompt,
            cached_tokens=cached,
            queue_s=queue_s,
        )

    async def abort(self, rid: str) -> None:
        running = self._running.get(rid)
        if running is None:
            if rid in self._waiting:
                self._aborted.add(rid)
            return
        _resolve(running.future, asyncio.get_running_loop().time())

    # -- sessions -----------------------------------------------------------------------

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or new_hex()
        if sid in self._sessions:
            raise EngineRequestError(f"session {sid!r} is already open")
        self._sessions[sid] = {}
        return sid

    async def close_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise NotFound(f"unknown session {session_id!r}")

    # -- control ------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        _, resumed = self._sync()
        self._paused = mode
        resumed.clear()
        if mode is PauseMode.ABORT:
            self._aborted |= self._waiting
            now = asyncio.get_running_loop().time()
            for running in list(self._running.values()):
                _resolve(running.future, now)

    async def resume(self) -> None:
        _, resumed = self._sync()
        self._paused = None
        resumed.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        version = next_weight_version(self.version, update)
        if self.model.update_s:
            await asyncio.sleep(self.model.update_s)
        self.version = version
        self._updates.append((asyncio.get_running_loop().time(), version))
        del self._updates[:-64]  # no request decodes across that many switches
        return version

    async def accepts_images(self) -> bool:
        return False

    @property
    def in_flight(self) -> int:
        """Requests decoding or waiting for a slot."""
        return len(self._running) + len(self._waiting)

    @property
    def sessions(self) -> int:
        """Sessions open (a parked episode holds none)."""
        return len(self._sessions)

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model="sim",
            vocab_size=self.model.vocab_size,
            max_context=self.model.max_context,
            weight_version=self.version,
            running=len(self._running),
            paused=self._paused is not None,
            sessions=len(self._sessions),
            extra={"max_batch_size": self.model.slots},
        )

    async def close(self) -> None:
        self._closed = True
        now = asyncio.get_running_loop().time()
        for running in list(self._running.values()):
            _resolve(running.future, now)
        if self._resumed is not None:
            self._resumed.set()


def _resolve(future: asyncio.Future[float | None], value: float | None) -> None:
    if not future.done():
        future.set_result(value)


# ---- the env ----------------------------------------------------------------------------


@dataclass
class EnvStats:
    steps: int = 0
    slept_s: float = 0.0
    episodes: int = 0


ENV_STATS = EnvStats()  # every SimEnv of the process adds to it (its kwargs are JSON)


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)])


@dataclass
class _EnvDraw:
    turns: int = 2
    success_p: float = 0.0
    latencies: list[float] = field(default_factory=list)


class SimEnv(TurnEnv):
    """An episode of seeded length whose steps only wait; see the module docstring."""

    env_id = ENV_ID
    accepted_actions: ClassVar[frozenset[str]] = frozenset({"text", "tool_calls"})

    def __init__(
        self,
        min_turns: int = 2,
        max_turns: int = 6,
        latency_median_s: float = 0.05,
        latency_sigma: float = 0.5,
        latency_max_s: float = 2.0,
    ) -> None:
        if not 1 <= min_turns <= max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        super().__init__(max_turns=max_turns)
        self.min_turns = min_turns
        self.latency_median_s = latency_median_s
        self.latency_sigma = latency_sigma
        self.latency_max_s = latency_max_s
        self.draw = _EnvDraw()

    async def _start(self, options: dict[str, Any]) -> Observation:
        rng = self.rng
        turns = rng.randint(self.min_turns, self.max_turns)
        mu = math.log(max(self.latency_median_s, 1e-9))
        latencies = [
            min(self.latency_max_s, rng.lognormvariate(mu, self.latency_sigma))
            if self.latency_median_s > 0
            else 0.0
            for _ in range(turns)
        ]
        self.draw = _EnvDraw(turns, rng.random(), latencies)
        ENV_STATS.episodes += 1
        return _user(f"Task {self.seed}: reach the end in {turns} steps. Begin.")

    async def _turn(self, action: Action) -> Outcome:
        delay = self.draw.latencies[self.turns - 1]
        if delay > 0:
            await asyncio.sleep(delay)
        ENV_STATS.steps += 1
        ENV_STATS.slept_s += delay
        if self.turns < self.draw.turns:
            return Outcome(_user(f"step {self.turns} ok"))
        text = action.text if isinstance(action, TextAction) else action.model_dump_json()
        coin = (zlib.crc32(text.encode()) ^ (self.seed or 0)) % 10_000 / 10_000
        success = coin < self.draw.success_p
        return Outcome(
            _user("done"),
            reward=1.0 if success else 0.0,
            terminated=True,
            info={"success": success},
        )


def register_env() -> None:
    """Make `registry.make(ENV_ID)` (and run configs naming it) build a `SimEnv`."""
    registry.register(ENV_ID, SimEnv, replace=True)
