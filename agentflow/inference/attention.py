"""Decode attention for the slot KV: one query token per row, rows of different lengths.

On CPU, SDPA's fused kernel spends more on blocking than on arithmetic for a single
query over a masked, strided key buffer; two small matmuls are about twice as fast.
Everything else (prefill, teacher forcing, models with soft-capping or sinks) goes to
transformers' own SDPA path, so numerics only change within float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "agentflow_decode"
_registered = False


def decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    special = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sliding_window"))
    if query.shape[2] != 1 or attention_mask is None or special or dropout:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        return out, None
    n, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # GQA: head h reads KV head h // group, so the group is a row block of the query.
    q = query.reshape(n, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2))
    scores = scores.mul_(scaling if scaling is not None else dim**-0.5).add_(attention_mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [n, kv_heads, group, dim]
    return out.reshape(n, 1, heads, dim), None


def register() -> str:
    """Make `NAME` a valid `config._attn_implementation` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, decode_attention)
        _registered = True
    return NAME
