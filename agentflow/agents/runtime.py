"""What a running run's agents sample from: its policy engine and chat template.

The gateway holds one `PolicyRuntime` per live run in a `RuntimeRegistry`; the white-box
loop and the OpenAI-compatible proxy both look the run up there, so black-box and
white-box episodes of one run share the engine (and its KV caches) and record alike.

Every generation goes through `PolicyRuntime.generate`, which is also where weight
updates meet running requests (docs/architecture.md, "Asynchrony and staleness"):
- with `partial_rollout`, an update pauses the engine at once (`retract` keeps requests
  queued in the engine; `abort` ends them with their partial output, and this runtime
  resubmits each as `input + partial output` with the rest of its token budget), so a
  long response is never restarted, and each token keeps the version that made it;
- without it, an update waits until the running generations finish (new ones wait
  for the update), so every response is made by one version; the engine idles meanwhile.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from agentflow.errors import NotFound
from agentflow.inference.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    TokenObserver,
    VersionSpan,
    WeightUpdate,
    generate_observed,
)
from agentflow.tokenization.chat import ChatTemplate


@dataclass
class GenerationLoad:
    """In-flight generations, and their time average per window (for the elastic pool)."""

    in_flight: int = 0
    _area: float = 0.0
    _since: float = field(default_factory=time.perf_counter)
    _window_start: float = field(default_factory=time.perf_counter)

    def change(self, delta: int) -> None:
        now = time.perf_counter()
        self._area += self.in_flight * (now - self._since)
        self._since = now
        self.in_flight += delta

    def take_mean(self) -> float:
        """Mean in-flight generations since the last call; starts a new window."""
        now = time.perf_counter()
        area = self._area + self.in_flight * (now - self._since)
        window = max(now - self._window_start, 1e-9)
        self._area, self._since, self._window_start = 0.0, now, now
        return area / window


@dataclass
class PolicyRuntime:
    engine: Engine
    template: ChatTemplate
    model_name: str = "policy"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_context: int = 4096
    partial_rollout: bool = True
    interrupt: PauseMode = PauseMode.RETRACT  # how an update interrupts (partial rollout)
    # How black-box requests become tokens: "append" token deltas after each recorded
    # answer, or "rerender" the whole conversation (agents/blackbox/matching.py).
    history: Literal["append", "rerender"] = "append"
    max_resubmits: int = 16
    load: GenerationLoad = field(default_factory=GenerationLoad)
    resubmitted: int = 0  # continuations sent after an abort (partial rollouts)
    _interruptions: int = 0  # bumped by every update that aborts running requests
    _updating: asyncio.Event | None = None  # set while no update waits (drain mode)
    _update_lock: asyncio.Lock | None = None
    _drained: asyncio.Condition | None = None

    def _sync(self) -> tuple[asyncio.Event, asyncio.Lock, asyncio.Condition]:
        if self._updating is None or self._update_lock is None or self._drained is None:
            self._updating = asyncio.Event()
            self._updating.set()
            self._update_lock = asyncio.Lock()
            self._drained = asyncio.Condition()
        return self._updating, self._update_lock, self._drained

    async def generate(
        self, req: GenerateRequest, observer: TokenObserver | None = None
    ) -> GenerateResult:
        """`engine.generate`, continued across weight updates (see the module docstring);
        `observer` sees the output tokens as they come, continuations included."""
        no_update, _, drained = self._sync()
        await no_update.wait()  # drain mode: a waiting update goes first
        self.load.change(+1)
        try:
            return await self._generate_through_updates(req, observer)
        finally:
            self.load.change(-1)
            # Only a draining update waits on `drained`; it clears `no_update` before it
            # looks at the load, so a generation that ends while the event is still set
            # has nothing to tell it.
            if not no_update.is_set():
                async with drained:
                    drained.notify_all()

    async def _generate_through_updates(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        interruptions = self._interruptions
        result = await generate_observed(self.engine, req, observer)
        pieces = [result]
        budget = req.sampling.max_new_tokens
        while (
            result.finish_reason == "abort"
            and self.partial_rollout
            and self._interruptions != interruptions  # an update aborted it, not a caller
            and len(pieces) <= self.max_resubmits
        ):
            produced = sum(len(p.output_ids) for p in pieces)
            if produced >= budget:
                break
            interruptions = self._interruptions
            partial = [t for p in pieces for t in p.output_ids]
            continuation = req.model_copy(
                update={
                    "input_ids": (*req.input_ids, *partial),
                    "sampling": req.sampling.model_copy(
                        update={"max_new_tokens": budget - produced}
                    ),
                }
            )
            self.resubmitted += 1
            result = await generate_observed(self.engine, continuation, observer)
            pieces.append(result)
        return pieces[0] if len(pieces) == 1 else _stitch(pieces)

    async def update_weights(self, update: WeightUpdate) -> int:
        """Switch the engine to new weights under this runtime's interruption policy."""
        no_update, lock, drained = self._sync()
        async with lock:
            if self.partial_rollout:
                if self.interrupt is PauseMode.ABORT:
                    self._interruptions += 1
                await self.engine.pause(self.interrupt)
                try:
                    return await self.engine.update_weights(update)
                finally:
                    await self.engine.resume()
            no_update.clear()
            try:
                async with drained:
                    await drained.wait_for(lambda: self.load.in_flight == 0)
                return await self.engine.update_weights(update)
            finally:
                no_update.set()


def _stitch(pieces: list[GenerateResult]) -> GenerateResult:
    """One result from a request and its continuations; spans shifted into place."""
    output: list[int] = []
    logprobs: list[float] = []
    spans: list[VersionSpan] = []
    tops: list[list[tuple[int, float]]] | None = (
        [] if all(p.top_logprobs is not None for p in pieces) else None
    )
    for piece in pieces:
        shift = len(output)
        for span in piece.weight_versions:
            start, end = span.start + shift, span.end + shift
            if spans and spans[-1].version == span.version and spans[-1].end == start:
                spans[-1] = VersionSpan(version=span.version, start=spans[-1].start, end=end)
            elif end > start:
                spans.append(VersionSpan(version=span.version, start=start, end=end))
        output += piece.output_ids
        logprobs += piece.logprobs
        if tops is not None and piece.top_logprobs is not None:
            tops += piece.top_logprobs
    last = pieces[-1]
    return last.model_copy(
        update={
            "output_ids": output,
            "logprobs": logprobs,
            "weight_versions": spans,
            "prompt_tokens": pieces[0].prompt_tokens,
            "cached_tokens": pieces[0].cached_tokens,
            "top_logprobs": tops,
        }
    )


class RuntimeRegistry:
    """Live runs' runtimes by run id."""

    def __init__(self) -> None:
        self._runtimes: dict[uuid.UUID, PolicyRuntime] = {}

    def register(self, run_id: uuid.UUID, runtime: PolicyRuntime) -> None:
        self._runtimes[run_id] = runtime

    def remove(self, run_id: uuid.UUID) -> PolicyRuntime | None:
        return self._runtimes.pop(run_id, None)

    def get(self, run_id: uuid.UUID | None) -> PolicyRuntime:
        if run_id is None or run_id not in self._runtimes:
            raise NotFound(f"run {run_id} has no live policy engine (is it running?)")
        return self._runtimes[run_id]

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runtimes

    def items(self) -> list[tuple[uuid.UUID, PolicyRuntime]]:
        return list(self._runtimes.items())
