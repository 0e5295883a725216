"""Batched token sampling: temperature, top-p, per-request seeds, and the log-prob to report.

One uniform number per row drives inverse-CDF sampling, so a request with a seed draws
from its own generator whatever else shares the batch. The reported log-prob is always
of the *unfiltered* `log_softmax(logits / T)` (unscaled for greedy): that is what the
trainer recomputes, and top-p only decides which token is drawn.
"""

from __future__ import annotations

import torch

from agentflow.inference.step_plan import RowSampling


def sample(
    logits: torch.Tensor, rows: list[RowSampling], shared: torch.Generator
) -> tuple[list[int], list[float]]:
    """Tokens and their log-probs for `logits` `[n, vocab]`, one `RowSampling` per row."""
    n = logits.shape[0]
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logp.argmax(dim=-1)

    if not bool(greedy.all()):
        probs = logp.exp()
        top_ps = [r.top_p for r in rows]
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
        drawn = idx if order is None else order.gather(1, idx)
        tokens = torch.where(greedy, tokens, drawn.squeeze(1))

    # Greedy rows report the unscaled log_softmax, which `logp` already is for them (T := 1).
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert chosen.shape[0] == n
    return tokens.tolist(), chosen.tolist()


def _uniforms(rows: list[RowSampling], shared: torch.Generator) -> torch.Tensor:
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    u = torch.empty(len(rows), dtype=torch.float32)
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=shared)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator)[0]
    return u
