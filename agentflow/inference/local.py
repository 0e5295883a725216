"""`LocalEngine`: in-process PyTorch serving of an HF-format causal LM, SGLang-alike.

Requests are batched continuously: a background task plans one step at a time on the
event loop (who decodes, who joins, who leaves) and runs its compute in one worker
thread (`ModelRunner`), so the loop stays responsive and requests join and leave
between decode steps. Scheduling state is only touched on the event loop, under
`_lock`, which is held across each step: pause, abort and weight updates therefore
always land between two steps.

Sessions follow SGLang: a request names `session.parent_rid` to continue that request's
prompt + output (cut to `offset`). The KV of a finished session request is kept under a
token budget (LRU); a child loads it and computes only the new tokens, or recomputes the
prefix when it was evicted. The reported `cached_tokens` counts the loaded prefix.

A step decodes one token for every running request; while no request waits and none has
finished, the worker keeps decoding up to `decode_burst` steps before handing back (any
call that needs the lock interrupts the burst), which halves the per-token overhead on
small models. Llama-family models decode and prefill through `fast_decode`, others
through their own HF forward; both write into the same slot KV and match a
teacher-forced forward.

Weight versions: every output token is tagged with the version current when it was
sampled. `pause(retract)` drops running requests' KV so that, after an update, their
context is recomputed under the new weights; `in_place` keeps it (tokens after the
update then come from new weights over an old-weights cache, as in SGLang).
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentflow.errors import EngineError, EngineRequestError, EngineUnavailable, NotFound
from agentflow.inference.base import (
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenObserver,
    VersionSpan,
    WeightUpdate,
    next_weight_version,
)
from agentflow.inference.scheduling import BatchScheduler, LiveRequest

if TYPE_CHECKING:
    from agentflow.modeling import ModelInit


@dataclass
class _Session:
    contexts: dict[str, list[int]] = field(default_factory=dict)  # rid -> prompt + output


class LocalEngine:
    """Serve `model` (an HF causal LM, eval mode) in process; see the module docstring."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch_size: int = 64,
        kv_budget_tokens: int = 65536,
        device: str = "cpu",
        weight_version: int = 0,
        model_name: str = "local",
        max_context: int | None = None,
        prefill_token_budget: int = 8192,
        seed: int = 0,
        decode_burst: int = 8,
        fast_decode: bool = True,
        fast_prefill: bool = True,
    ) -> None:
        from agentflow.inference.model_runner import ModelRunner

        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if kv_budget_tokens < 0:
            raise ValueError("kv_budget_tokens must be >= 0")
        self.model = model.to(device).eval()
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.prefill_token_budget = prefill_token_budget
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        cfg_ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.max_context = max_context or cfg_ctx
        if self.max_context <= 0:
            raise ValueError("max_context unknown: pass max_context=")
        self.weight_version = weight_version
        self._runner = ModelRunner(
            self.model,
            slots=max_batch_size,
            kv_budget_tokens=kv_budget_tokens,
            seed=seed,
            fast_decode=fast_decode,
            fast_prefill=fast_prefill,
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine")
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._sched = BatchScheduler(
            max_batch_size=max_batch_size,
            prefill_token_budget=prefill_token_budget,
            max_context=self.max_context,
            burst=decode_burst,
        )
        self._by_rid: dict[str, LiveRequest] = {}
        self._sessions: dict[str, _Session] = {}
        self._paused: PauseMode | None = None
        self._closed = False
        self.steps = 0

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_init(cls, init: ModelInit, seed: int = 0, **kw: Any) -> LocalEngine:
        """Serve a randomly initialised model built from `init` (same seed, same weights)."""
        from agentflow.modeling import build_model

        kw.setdefault("max_context", init.max_context)
        return cls(build_model(init, seed=seed), **kw)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kw: Any) -> LocalEngine:
        """Serve the HF-format checkpoint in the local directory `path`."""
        from agentflow.modeling import load_model

        kw.setdefault("model_name", Path(path).name)
        return cls(load_model(path, device=kw.get("device", "cpu")), **kw)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if self._task is not None and self._task.get_loop() is not asyncio.get_running_loop():
            raise EngineUnavailable("the engine serves another event loop; make one per loop")
        if self._task is None:
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            assert self._lock is not None and self._wake is not None
            self._runner.interrupt.set()
            async with self._lock:
                for r in [*self._sched.rows, *self._sched.waiting]:
                    if not r.done:
                        self._finish(r, "abort")
            self._wake.set()
            await self._task
        self._executor.shutdown(wait=True)

    # -- requests -----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await self.generate_observed(req, None)

    async def generate_observed(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        """`generate`, calling `observer` with each step's new tokens (`StreamingEngine`)."""
        if req.image_data:
            raise EngineRequestError("this engine does not accept images (a text-only model)")
        await self.start()
        assert self._wake is not None
        r = self._admit(req)
        r.observer = observer
        self._by_rid[req.rid] = r
        self._sched.waiting.append(r)
        self._runner.interrupt.set()  # end a decode burst so it joins at the next step
        self._wake.set()
        try:
            return await asyncio.shield(r.future)
        except asyncio.CancelledError:
            # The caller gave up: free the slot too, so the batch is not held by nobody.
            await self.abort(req.rid)
            raise

    def _admit(self, req: GenerateRequest) -> LiveRequest:
        """Validate `req` and build its state; raises `EngineRequestError` on bad input."""
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if not req.input_ids:
            raise EngineRequestError("input_ids is empty")
        if req.sampling.max_new_tokens < 1:
            raise EngineRequestError(
                f"max_new_tokens must be >= 1, got {req.sampling.max_new_tokens}"
            )
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRequestError(
                f"input_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if req.rid in self._by_rid:
            raise EngineRequestError(f"rid {req.rid!r} is already running")
        prefix: list[int] = []
        session_id = load_rid = None
        if req.session is not None:
            session_id = req.session.session_id
            session = self._sessions.get(session_id)
            if session is None:
                raise EngineRequestError(f"unknown session {session_id!r}")
            if req.session.parent_rid is not None:
                parent = session.contexts.get(req.session.parent_rid)
                if parent is None:
                    raise EngineRequestError(
                        f"unknown parent rid {req.session.parent_rid!r} in session {session_id!r}"
                    )
                offset = req.session.offset
                if offset is not None and offset > len(parent):
                    raise EngineRequestError(
                        f"offset {offset} is past the parent's context ({len(parent)} tokens)"
                    )
                prefix = parent[:offset] if offset is not None else list(parent)
                load_rid = req.session.parent_rid
        context = prefix + list(req.input_ids)
        sp = req.sampling
        if len(context) + sp.max_new_tokens > self.max_context:
            raise EngineRequestError(
                f"context ({len(context)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                f"exceeds the context length {self.max_context}"
            )
        generator = None
        if sp.seed is not None:
            import torch

            generator = torch.Generator().manual_seed(sp.seed)
        loop = asyncio.get_running_loop()
        return LiveRequest(
            req=req,
            future=loop.create_future(),
            context=context,
            prompt_len=len(context),
            session_id=session_id,
            load_rid=load_rid,
            load_max=len(prefix),
            generator=generator,
            tops=[] if sp.top_logprobs else None,
        )

    async def abort(self, rid: str) -> None:
        r = self._by_rid.get(rid)
        if r is None or self._lock is None:
            return
        self._runner.interrupt.set()
        async with self._lock:
            if not r.done:
                self._finish(r, "abort")

    # -- sessions -----------------------------------------------------------------------

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise EngineRequestError(f"session {sid!r} is already open")
        self._sessions[sid] = _Session()
        return sid

    async def close_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}")
        await self.start()
        assert self._lock is not None
        self._runner.interrupt.set()
        async with self._lock:
            rids = set(session.contexts)
            saves = self._sched.pending_saves
            self._sched.pending_saves = [s for s in saves if s[0] not in rids]
            for rid in rids:
                self._runner.store.drop(rid)

    # -- pause / weights ----------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        await self.start()
        assert self._lock is not None
        self._runner.interrupt.set()
        async with self._lock:
            self._paused = mode
            if mode is PauseMode.ABORT:
                for r in [*self._sched.rows, *self._sched.waiting]:
                    if not r.done:
                        self._finish(r, "abort")
            elif mode is PauseMode.RETRACT:
                self._sched.retract()

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
        self._runner.interrupt.set()
        async with self._lock:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(
                    self._executor, self._runner.load_weights, update.state_dict, update.path
                )
            except EngineError:
                raise
            except Exception as e:  # a bad file or tensor fails this update, not the engine
                raise EngineRequestError(f"weight update failed: {e}") from e
            self.weight_version = version
            if self._paused is not PauseMode.IN_PLACE:
                # Stored session KV was computed by the old weights.
                self._sched.pending_saves.clear()
                self._runner.store.clear()
        return version

    def reseed(self, seed: int) -> None:
        """Draw unseeded requests' samples from a stream started at `seed` (engines of one
        pool sample differently from the same weights)."""
        self._runner.shared_generator.manual_seed(seed)

    def weight_names(self) -> list[str]:
        """The parameters a full weight update must cover (a tied output layer is not one:
        it is the embedding)."""
        return [name for name, _ in self._runner.model.named_parameters()]

    async def accepts_images(self) -> bool:
        """Never: the local models are text-only."""
        return False

    async def info(self) -> EngineInfo:
        store = self._runner.store
        return EngineInfo(
            model=self.model_name,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            weight_version=self.weight_version,
            running=sum(not r.done for r in self._sched.rows),
            waiting=len(self._sched.waiting),
            paused=self._paused is not None,
            sessions=len(self._sessions),
            kv_tokens=store.tokens,
            extra={
                "device": str(self._runner.device),
                "max_batch_size": self.max_batch_size,
                "kv_budget_tokens": store.budget_tokens,
                "kv_evictions": store.evictions,
                "steps": self.steps,
            },
        )

    def score(self, token_ids: list[int], temperature: float = 1.0, start: int = 1) -> list[float]:
        """Teacher-forced log-probs under the engine's current weights (see `modeling.score`)."""
        from agentflow.modeling import score

        with self._runner.lock:
            return score(self.model, token_ids, temperature, start=start)

    # -- the serving loop ---------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._lock is not None and self._wake is not None
        loop = asyncio.get_running_loop()
        sched = self._sched
        while not self._closed:
            await self._wake.wait()
            async with self._lock:
                if self._closed:
                    break
                paused = self._paused is not None
                if not sched.needs_step(paused):
                    self._wake.clear()
                    continue
                self._runner.interrupt.clear()
                joined: list[LiveRequest] = []
                try:
                    plan, joined = sched.plan(run=not paused)
                    out = await loop.run_in_executor(self._executor, self._runner.step, plan)
                    self.steps += len(out.tokens)  # decode steps, bursts included
                    sched.apply(out, joined, self.weight_version, self._finish)
                except Exception as e:  # fail this step's requests, keep serving the rest
                    self._fail_step([*sched.rows, *joined], e)
            await asyncio.sleep(0)  # let pause/abort/update take the lock between steps

    def _fail_step(self, rows: list[LiveRequest], e: Exception) -> None:
        err = EngineError(f"engine step failed: {type(e).__name__}: {e}")
        for r in rows:
            r.done = True
            self._by_rid.pop(r.rid, None)
            if not r.future.done():
                r.future.set_exception(err)
        self._sched.rows = []
        self._sched.pending_saves = []

    def _finish(self, r: LiveRequest, reason: FinishReason) -> None:
        """End `r`: resolve its future, and keep its context (and KV) if it is in a session."""
        r.done = True
        self._by_rid.pop(r.rid, None)
        if r in self._sched.waiting:
            self._sched.waiting.remove(r)
        session = self._sessions.get(r.session_id) if r.session_id else None
        if session is not None:
            session.contexts[r.rid] = list(r.context)
            r.save_kv = r.slot is not None and r.kv_len > 0
        if not r.future.done():
            r.future.set_result(
                GenerateResult(
                    rid=r.rid,
                    output_ids=list(r.output),
                    logprobs=list(r.logprobs),
                    finish_reason=reason,
                    weight_versions=[VersionSpan(version=v, start=s, end=e) for v, s, e in r.spans],
                    prompt_tokens=r.prompt_len,
                    cached_tokens=r.cached_tokens or 0,
                    queue_s=r.queue_s or 0.0,
                    top_logprobs=r.tops,
                )
            )
