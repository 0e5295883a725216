"""Continuous batching for the local engine: which request decodes, joins or leaves a step.

`BatchScheduler` lives on the event loop. Before each step it turns its queues into a
`StepPlan` for the `ModelRunner` (rows that left are saved and their holes filled, waiting
requests join while slots and the prefill budget allow); after the step it appends each
row's token and ends the rows that hit a stop token or their length limit. Nothing here
touches tensors except the per-request seed generator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentflow.inference.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenObserver,
)
from agentflow.inference.step_plan import Join, RowSampling, StepOutput, StepPlan

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LiveRequest:
    """One request from submission to result."""

    req: GenerateRequest
    future: asyncio.Future[GenerateResult]
    context: list[int]  # parent prefix + input + output so far
    prompt_len: int
    session_id: str | None
    load_rid: str | None  # a finished request whose stored KV may cover a prefix
    load_max: int
    generator: Any  # torch.Generator for a seeded request, else None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)  # [version, start, end]
    cached_tokens: int | None = None  # set at first admission
    submitted_at: float = field(default_factory=time.perf_counter)
    queue_s: float | None = None  # waited for a slot: set at first admission
    slot: int | None = None
    kv_len: int = 0  # context tokens whose KV sits in the slot
    done: bool = False
    save_kv: bool = False  # keep this row's KV for child requests when it leaves
    observer: TokenObserver | None = None  # shown each step's new tokens
    tops: list[list[tuple[int, float]]] | None = None  # per output token, when asked

    @property
    def rid(self) -> str:
        return self.req.rid

    def add_token(
        self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None = None
    ) -> None:
        if self.tops is not None:
            self.tops.append(top or [])
        self.context.append(token)
        self.output.append(token)
        self.logprobs.append(logprob)
        n = len(self.output)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n
        else:
            self.spans.append([version, n - 1, n])


class BatchScheduler:
    def __init__(
        self,
        *,
        max_batch_size: int,
        prefill_token_budget: int,
        max_context: int,
        burst: int = 8,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.burst = burst
        self.prefill_token_budget = prefill_token_budget
        self.max_context = max_context
        self.waiting: deque[LiveRequest] = deque()
        self.rows: list[LiveRequest] = []  # running; rows[i].slot == i after each plan
        self.pending_saves: list[tuple[str, int, int]] = []  # (rid, slot, length)

    def needs_step(self, paused: bool) -> bool:
        if self.pending_saves or any(r.done for r in self.rows):
            return True
        return not paused and bool(self.rows or self.waiting)

    def _collect_leaving(self) -> list[int]:
        """Drop finished rows, queueing their KV saves; returns the slots they free."""
        freed: list[int] = []
        for r in self.rows:
            if r.done:
                assert r.slot is not None
                if r.save_kv:
                    self.pending_saves.append((r.rid, r.slot, r.kv_len))
                freed.append(r.slot)
                r.slot = None
        self.rows = [r for r in self.rows if not r.done]
        return freed

    def retract(self) -> None:
        """Send running requests back to the queue front; their KV will be recomputed."""
        self._collect_leaving()
        for r in self.rows:
            r.slot, r.kv_len = None, 0
        self.waiting.extendleft(reversed(self.rows))
        self.rows = []

    def plan(self, run: bool) -> tuple[StepPlan, list[LiveRequest]]:
        """The next step; `run=False` (paused) only saves and compacts."""
        freed = self._collect_leaving()
        plan = StepPlan(saves=self.pending_saves)
        self.pending_saves = []
        n = len(self.rows)
        # Fill holes below n with rows from the end: one row copy per hole.
        holes = sorted(s for s in freed if s < n)
        tails = sorted(
            (r for r in self.rows if r.slot is not None and r.slot >= n), key=lambda r: r.slot or 0
        )
        for hole, r in zip(holes, tails, strict=True):
            assert r.slot is not None
            plan.moves.append((r.slot, hole, r.kv_len))
            r.slot = hole
        self.rows.sort(key=lambda r: r.slot or 0)
        if not run:
            return plan, []
        for r in self.rows:
            plan.decode_tokens.append(r.context[r.kv_len])
            plan.decode_pos.append(r.kv_len)
            self._add_row(plan, r)
        joined: list[LiveRequest] = []
        width = 0
        while self.waiting and n + len(joined) < self.max_batch_size:
            r = self.waiting[0]
            new_width = max(width, len(r.context))
            if joined and (len(joined) + 1) * new_width > self.prefill_token_budget:
                break
            self.waiting.popleft()
            if r.queue_s is None:
                r.queue_s = time.perf_counter() - r.submitted_at
            width = new_width
            r.slot = n + len(joined)
            joined.append(r)
            plan.joins.append(Join(r.slot, list(r.context), r.load_rid, r.load_max))
            self._add_row(plan, r)
        # Bursts only when nobody waits for a slot: a waiting request joins next step.
        plan.burst = self.burst if not self.waiting else 1
        return plan, joined

    def _add_row(self, plan: StepPlan, r: LiveRequest) -> None:
        sp = r.req.sampling
        plan.sampling.append(
            RowSampling(
                temperature=sp.temperature,
                top_p=sp.top_p,
                generator=r.generator,
                top_logprobs=sp.top_logprobs,
            )
        )
        plan.limits.append(
            min(sp.max_new_tokens - len(r.output), self.max_context - len(r.context))
        )
        plan.stops.append(frozenset(sp.stop_token_ids))

    def apply(
        self,
        out: StepOutput,
        joined: list[LiveRequest],
        version: int,
        finish: Callable[[LiveRequest, FinishReason], None],
    ) -> None:
        """Append each row's sampled tokens; end rows that stop or run out of length."""
        for r, cached in zip(joined, out.cached, strict=True):
            if r.cached_tokens is None:
                r.cached_tokens = cached
        stepped = [*self.rows, *joined]
        before = [len(r.output) for r in stepped]
        tops = out.tops or [[None] * len(stepped)] * len(out.tokens)
        for step, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
            for i, (r, tok, lp) in enumerate(zip(stepped, tokens, logprobs, strict=True)):
                # A burst ends at the first finish, so a finished row never gets more tokens.
                assert not r.done or r.future.done()
                if r.done:
                    continue
                r.kv_len = len(r.context)
                r.add_token(tok, lp, version, tops[step][i])
                sp = r.req.sampling
                if tok in sp.stop_token_ids:
                    finish(r, "stop")
                elif len(r.output) >= sp.max_new_tokens or len(r.context) >= self.max_context:
                    finish(r, "length")
        for r, n in zip(stepped, before, strict=True):
            if r.observer is not None and len(r.output) > n:
                _show(r.observer, r.output[n:], r.logprobs[n:])
        self.rows = stepped


def _show(observer: TokenObserver, ids: list[int], logprobs: list[float]) -> None:
    """An observer's failure is its caller's problem, never the batch's."""
    try:
        observer(ids, logprobs)
    except Exception:
        log.exception("a token observer failed")
