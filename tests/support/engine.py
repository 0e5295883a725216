"""`MockEngine`, the one fake `Engine` of the tests and benchmarks, and `RecordingEngine`,
which records what a real engine was asked.

`MockEngine` keeps the protocol as `LocalEngine` does, without a model:

- what a request produces comes from `generate_fn(request, engine)`: an iterable of token
  ids, or of `(id, logprob)` pairs, pulled one token per step, so a generator that reads
  `engine.weight_version` sees the version of the step it is in. When it is called,
  `engine.contexts[request.rid]` holds the request's full context. The request ends with
  `stop` on a stop id or when the iterable runs out, with `length` at `max_new_tokens`.
  The default answers "7", then the request's first stop id;
- sessions are trees of requests: a request's context is its parent's prompt + output (cut
  to `offset`) + its own `input_ids`, and `cached_tokens` is the parent's part;
- requests wait while the engine is paused; `pause(abort)` and `abort(rid)` end running
  requests with their partial output, and the other pause modes hold them between steps;
- every output token is tagged with the weight version current when it was made; a weight
  update names a newer version (or takes the next one), and a `path` under `/missing` fails
  to load, as a directory that is not there would.

Timing: `delay_s` once per request before its first step, `step_s` per token; both count
as running (`running`, `peak`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from agentflow.errors import EngineRequestError, NotFound
from agentflow.inference.base import (
    Engine,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenObserver,
    VersionSpan,
    WeightUpdate,
    generate_observed,
    next_weight_version,
)
from agentflow.tokenization.bytes import ByteTokenizer

Token = int | tuple[int, float]
GenerateFn = Callable[[GenerateRequest, "MockEngine"], Iterable[Token]]


def answer_seven(request: GenerateRequest, engine: MockEngine) -> list[int]:
    """The default answer: "7", then the request's first stop id (when it has one)."""
    return [ord("7"), *request.sampling.stop_token_ids[:1]]


def replay(replies: Iterable[Sequence[int]]) -> GenerateFn:
    """Answer each request with the next of `replies`, in order."""
    queue = deque(list(reply) for reply in replies)

    def generate(request: GenerateRequest, engine: MockEngine) -> list[int]:
        return queue.popleft()

    return generate


def _spans(versions: Sequence[int]) -> list[VersionSpan]:
    spans: list[VersionSpan] = []
    for i, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version=version, start=spans[-1].start, end=i + 1)
        else:
            spans.append(VersionSpan(version=version, start=i, end=i + 1))
    return spans


class _Record:
    """Per rid: the full context a request ran on and its result, in the order they ended."""

    def __init__(self) -> None:
        self.contexts: dict[str, list[int]] = {}
        self.results: dict[str, GenerateResult] = {}
        self.order: list[str] = []

    def seen(self, rid: str) -> list[int]:
        """Context and output of request `rid`: what a request continuing it starts from."""
        return self.contexts[rid] + self.results[rid].output_ids

    def _record(self, rid: str, context: list[int], result: GenerateResult) -> None:
        self.contexts[rid] = context
        self.results[rid] = result
        self.order.append(rid)


class MockEngine(_Record):
    """A configurable engine without a model; see the module docstring."""

    def __init__(
        self,
        generate_fn: GenerateFn = answer_seven,
        *,
        delay_s: float = 0.0,
        step_s: float = 0.0,
        logprob: float = -0.1,
        model: str = "mock",
        vocab_size: int = ByteTokenizer().vocab_size,
        max_context: int = 4096,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.generate_fn = generate_fn
        self.delay_s = delay_s
        self.step_s = step_s
        self.logprob = logprob  # of tokens `generate_fn` gives without one
        self.model = model
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.extra = dict(extra or {})  # what info() reports there (e.g. max_batch_size)
        self.weight_version = 0
        self.updates: list[WeightUpdate] = []  # the weight updates it switched to
        self.sessions: dict[str, dict[str, list[int]]] = {}  # sid -> rid -> context + output
        self.running: set[str] = set()
        self.peak = 0
        self.started = asyncio.Event()  # set when any request produced its first token
        self.closed = False
        self._mode: PauseMode | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborted: set[str] = set()

    def _context(self, req: GenerateRequest) -> tuple[list[int], int]:
        """The request's full context and how much of it is its session's history."""
        if any(not 0 <= t < self.vocab_size for t in req.input_ids):
            raise EngineRequestError(f"input_ids outside the vocabulary [0, {self.vocab_size})")
        if req.session is None:
            return list(req.input_ids), 0
        tree = self.sessions.get(req.session.session_id)
        if tree is None:
            raise EngineRequestError(f"unknown session {req.session.session_id}")
        parent: list[int] = []
        if req.session.parent_rid is not None:
            if req.session.parent_rid not in tree:
                raise EngineRequestError(f"unknown parent rid {req.session.parent_rid}")
            parent = tree[req.session.parent_rid][: req.session.offset]
        return parent + list(req.input_ids), len(parent)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        context, cached = self._context(req)
        await self._resumed.wait()
        self.running.add(req.rid)
        self.peak = max(self.peak, len(self.running))
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: FinishReason = "length"
        try:
            await asyncio.sleep(self.delay_s)
            self.contexts[req.rid] = context
            tokens = iter(self.generate_fn(req, self))
            while len(out) < req.sampling.max_new_tokens:
                await asyncio.sleep(self.step_s)  # the "forward pass"
                # Pause and abort land between steps, as in LocalEngine.
                if self._mode is not None and self._mode is not PauseMode.ABORT:
                    await self._resumed.wait()
                if req.rid in self._aborted or self._mode is PauseMode.ABORT:
                    reason = "abort"
                    break
                item = next(tokens, None)
                if item is None:
                    reason = "stop"
                    break
                token, logprob = item if isinstance(item, tuple) else (item, self.logprob)
                out.append(token)
                logprobs.append(logprob)
                versions.append(self.weight_version)
                self.started.set()
                if token in req.sampling.stop_token_ids:
                    reason = "stop"
                    break
        finally:
            self.running.discard(req.rid)
            self._aborted.discard(req.rid)
        if req.session is not None and req.session.session_id in self.sessions:
            self.sessions[req.session.session_id][req.rid] = context + out
        result = GenerateResult(
            rid=req.rid,
            output_ids=out,
            logprobs=logprobs,
            finish_reason=reason,
            weight_versions=_spans(versions),
            prompt_tokens=len(context),
            cached_tokens=cached,
        )
        self._record(req.rid, context, result)
        return result

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise EngineRequestError(f"session {sid} already exists")
        self.sessions[sid] = {}
        return sid

    async def close_session(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise NotFound(f"unknown session {session_id}")

    async def abort(self, rid: str) -> None:
        if rid in self.running:
            self._aborted.add(rid)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._mode = PauseMode(mode)
        self._resumed.clear()
        if self._mode is PauseMode.ABORT:
            # Abort at the pause itself, as an engine does: a request mid-step must not
            # miss it when update and resume follow before its step ends.
            self._aborted |= self.running

    async def resume(self) -> None:
        self._mode = None
        self._resumed.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        if update.path is not None and update.path.startswith("/missing"):
            raise EngineRequestError(f"no model at {update.path}")
        self.weight_version = next_weight_version(self.weight_version, update)
        self.updates.append(update)
        return self.weight_version

    async def accepts_images(self) -> bool:
        return False  # the mock makes up tokens; it sees no images

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.model,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            weight_version=self.weight_version,
            running=len(self.running),
            paused=not self._resumed.is_set(),
            sessions=len(self.sessions),
            extra=dict(self.extra),
        )

    async def close(self) -> None:
        self.closed = True


class RecordingEngine(_Record):
    """Another engine (a real `LocalEngine`, say), recording per rid the full context each
    request ran on (session history resolved) and what it made."""

    def __init__(self, inner: Engine) -> None:
        super().__init__()
        self.inner = inner

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await self.generate_observed(req, None)

    async def generate_observed(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        """Streams where the inner engine does (`StreamingEngine`)."""
        parent: list[int] = []
        if req.session is not None and req.session.parent_rid is not None:
            parent = self.seen(req.session.parent_rid)[: req.session.offset]
        result = await generate_observed(self.inner, req, observer)
        self._record(req.rid, parent + list(req.input_ids), result)
        return result

    async def open_session(self, session_id: str | None = None) -> str:
        return await self.inner.open_session(session_id)

    async def close_session(self, session_id: str) -> None:
        await self.inner.close_session(session_id)

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self.inner.update_weights(update)

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def accepts_images(self) -> bool:
        return await self.inner.accepts_images()

    async def close(self) -> None:
        await self.inner.close()
