"""Batched token sampling: temperature, top-p, per-request seeds, and the log-prob to report.

One uniform number per row drives inverse-CDF sampling, so a request with a seed draws
from its own generator whatever else shares the batch. The reported log-prob is always
of the *unfiltered* `log_softmax(logits / T)` (unscaled for greedy): that is what the
trainer recomputes, and top-p only decides which token is drawn.
"""

from __future__ import annotations

import torch

from agentflow.inference.step_plan import RowSampling

TopLogprobs = list[tuple[int, float]]


def sample(
    logits: torch.Tensor, rows: list[RowSampling], shared: torch.Generator
) -> tuple[list[int], list[float]]:
    """Tokens and their log-probs for `logits` `[n, vocab]`, one `RowSampling` per row."""
    tokens, logprobs, _ = sample_with_tops(logits, rows, shared)
    return tokens, logprobs


def sample_with_tops(
    logits: torch.Tensor, rows: list[RowSampling], shared: torch.Generator
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """`sample`, and per row the `top_logprobs` most likely tokens with their log-probs
    (of the same distribution as the reported log-prob), or None where none were asked."""
    n = logits.shape[0]
    logits = logits.float()
    device = logits.device
    temp_list = [r.temperature for r in rows]
    greedy_list = [t == 0 for t in temp_list]
    all_greedy, any_greedy = all(greedy_list), any(greedy_list)
    # Decisions on plain floats, not tensors: no per-step host round trip, fewer tiny ops.
    if all(t == 1.0 or t == 0 for t in temp_list):
        scaled = logits  # dividing by 1 is exact
    else:
        temps = torch.tensor(temp_list, dtype=torch.float32, device=device)
        scaled = logits / torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logp.argmax(dim=-1) if any_greedy else None

    if not all_greedy:
        top_ps = [r.top_p for r in rows]
        probs = logp.exp()
        if any(p < 1.0 for p in top_ps):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            top = torch.tensor(top_ps, dtype=torch.float32, device=device).unsqueeze(1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            sorted_p = sorted_p.masked_fill(cum - sorted_p >= top, 0.0)
        else:
            sorted_p, order = probs, None
        u = _uniforms(rows, shared).to(device)
        cdf = sorted_p.cumsum(dim=-1)
        # right=True skips zero-probability entries; u < 1 keeps the index in range.
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
        idx = idx.clamp_(max=logits.shape[1] - 1)
        drawn = (idx if order is None else order.gather(1, idx)).squeeze(1)
        if tokens is None:
            tokens = drawn
        else:
            greedy = torch.tensor(greedy_list, device=device)
            tokens = torch.where(greedy, tokens, drawn)
    assert tokens is not None

    # Greedy rows report the unscaled log_softmax, which `logp` already is for them (T := 1).
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert chosen.shape[0] == n
    return tokens.tolist(), chosen.tolist(), _tops(logp, rows)


def _tops(logp: torch.Tensor, rows: list[RowSampling]) -> list[TopLogprobs | None]:
    k = max((r.top_logprobs for r in rows), default=0)
    if k <= 0:
        return [None] * len(rows)
    values, ids = logp.topk(min(k, logp.shape[1]), dim=-1)
    rows_of = zip(ids.tolist(), values.tolist(), strict=True)
    pairs = [list(zip(i, v, strict=True)) for i, v in rows_of]
    return [p[: r.top_logprobs] or None for p, r in zip(pairs, rows, strict=True)]


def _uniforms(rows: list[RowSampling], shared: torch.Generator) -> torch.Tensor:
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        return torch.rand(len(rows), generator=shared)  # the same draws as the loop below
    u = torch.empty(len(rows), dtype=torch.float32)
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=shared)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator)[0]
    return u
