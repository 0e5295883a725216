"""A lean decode step for Llama-family models (Llama, Mistral, Qwen2) over the slot KV.

Decoding small models on CPU is dominated by per-call overhead, not arithmetic: the HF
forward spends more time in kwargs plumbing, decorators and dispatch than in its tiny
matmuls. This step calls the very same modules (norms, projections, MLP, rotary,
`lm_head`) in the same order with the same formulas, and only drops the plumbing, so it
matches the HF forward to float rounding. Other architectures use the generic HF path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentflow.inference.kv_cache import SlotKV

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def supports(model: Any) -> bool:
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaDecodeStep:
    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the concatenated q/k/v and gate/up weights from the model's current ones."""
        fused = []
        with torch.no_grad():
            for layer in self.model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                bias = None
                if a.q_proj.bias is not None:
                    bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                fused.append((qkv, bias, gate_up))
        self._fused = fused

    def __call__(
        self, kv: SlotKV, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """Logits `[n, vocab]` for one token per row `[0, n)`; `mask` is `[n, 1, 1, kv_len]`."""
        inner = self.model.model
        n = ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        # 2D activations [n, hidden] throughout: one token per row, no sequence axis.
        h = inner.embed_tokens(ids[:, 0])
        cos, sin = inner.rotary_emb(h, position_ids=pos)  # [n, 1, dim]: broadcasts over heads
        rows = torch.arange(n, device=ids.device)
        at = pos[:, 0]
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b, gate_up_w = self._fused[i]
            qkv = F.linear(_rms_norm(layer.input_layernorm, h), qkv_w, qkv_b)
            q = qkv[:, :q_end].view(n, heads, dim)
            k = qkv[:, q_end:k_end].view(n, kv_heads, dim)
            v = qkv[:, k_end:].view(n, kv_heads, dim)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            keys, values = kv.k[i], kv.v[i]
            keys[rows, :, at] = k.to(keys.dtype)
            values[rows, :, at] = v.to(values.dtype)
            keys, values = keys[:n, :, :kv_len], values[:n, :, :kv_len]
            # GQA: head h reads KV head h // group, so a group is a block of query rows.
            scores = torch.matmul(q.view(n, kv_heads, group, dim), keys.transpose(-1, -2))
            scores = scores.mul_(attn.scaling).add_(mask)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            out = torch.matmul(probs, values).reshape(n, heads * dim)
            h = h + attn.o_proj(out)
            x = _rms_norm(layer.post_attention_layernorm, h)
            gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
        h = _rms_norm(inner.norm, h)
        return self.model.lm_head(h).float()
