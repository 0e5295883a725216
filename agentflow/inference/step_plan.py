"""What the scheduler hands the model runner for one step, and what comes back.

Plain data, no torch import: the scheduler (and so `agentflow.inference.local`) can be
imported without loading torch; only the runner that executes a plan needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    generator: Any  # a torch.Generator for a seeded request; None: the shared one
    top_logprobs: int = 0  # report this many most likely tokens per step


@dataclass
class Join:
    """A request entering slot `slot` with full context `context`."""

    slot: int
    context: list[int]
    load_rid: str | None  # a finished request whose stored KV may cover a prefix
    load_max: int  # at most this many context tokens may come from `load_rid`


@dataclass
class StepPlan:
    saves: list[tuple[str, int, int]] = field(default_factory=list)  # (rid, slot, length)
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, length)
    decode_tokens: list[int] = field(default_factory=list)  # rows [0, n) in order
    decode_pos: list[int] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)  # rows [n, n + len(joins))
    sampling: list[RowSampling] = field(default_factory=list)  # decode rows, then joins
    # Burst decoding: per row, tokens it may still produce and its stop ids.
    burst: int = 1
    limits: list[int] = field(default_factory=list)
    stops: list[frozenset[int]] = field(default_factory=list)


@dataclass
class StepOutput:
    tokens: list[list[int]]  # per decode step, one token per row
    logprobs: list[list[float]]
    cached: list[int]  # per join: context tokens whose KV came from the store
    # per decode step, per row: the most likely (token, log-prob) pairs, or None
    tops: list[list[list[tuple[int, float]] | None]] = field(default_factory=list)
