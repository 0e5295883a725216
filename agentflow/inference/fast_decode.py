"""Lean decode and prefill for Llama-family models (Llama, Mistral, Qwen2) over the slot KV.

Decoding small models on CPU is dominated by per-call overhead, not arithmetic: the HF
forward spends more time in kwargs plumbing, decorators and dispatch than in its tiny
matmuls. These paths call the very same weights (norms, projections, MLP, rotary,
`lm_head`) in the same order with the same formulas, and only drop the plumbing and
fuse neighbouring ops (q/k rotary in one pass, scale + mask inside the score matmul,
residual adds inside the projections), so they match the HF forward to float rounding.
A prefill also stops computing what no logit needs: after the last layer's K/V are
written, only each row's last token goes on. Other architectures use the HF forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentflow.inference.kv_cache import SlotKV

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# Rotary types whose cos/sin depend on the position only, so a table can be cached;
# the others (dynamic, longrope) rescale with the sequence length and are called per step.
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})


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


def _rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """HF's `weight * (x * rsqrt(mean(x^2) + eps))` in float32, as one fused op."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(x.dtype)


def _eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    return float(eps) if eps is not None else 1e-6


class _Linear:
    """`x @ W.T (+ b)` with the weight kept in the layout the device multiplies fastest.

    On CPU, oneDNN/MKL multiply a skinny activation by a row-major `[in, out]` matrix
    1.3-1.9x faster than by the transposed view `F.linear` passes (measured on the decode
    shapes, batch 32), so the step keeps its own transposed copy there. GPUs are
    indifferent to the transpose, and there a copy would double the weights' memory.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias
        self.w_t = weight.t().contiguous() if weight.device.type == "cpu" else weight.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.w_t)
        return torch.addmm(self.bias, x, self.w_t)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`h + self(x)`: the residual add inside the multiply when there is no bias."""
        if self.bias is None:
            return torch.addmm(h, x, self.w_t)
        return torch.addmm(h + self.bias, x, self.w_t)


class _Layer:
    """One decoder layer's weights, fused where the step can use them fused."""

    def __init__(self, layer: Any, heads: int, kv_heads: int, head_dim: int) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        a, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.input_eps = _eps(layer.input_layernorm)
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = _eps(layer.post_attention_layernorm)
        self.scaling = float(a.scaling)
        qkv_b = None
        if a.q_proj.bias is not None:
            qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        self.qkv = _Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b)
        self.o_proj = _Linear(a.o_proj.weight, a.o_proj.bias)
        gate_up_b = None
        if getattr(mlp.gate_proj, "bias", None) is not None:
            gate_up_b = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.gate_up = _Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up_b)
        self.act_fn = mlp.act_fn
        self.down_proj = _Linear(mlp.down_proj.weight, getattr(mlp.down_proj, "bias", None))

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens `h` `[t, hidden]`: q `[t, heads, dim]` and k, v `[t * kv_heads, dim]`,
        rotary applied to q and k (`cos`, `sin` `[t, 1, dim]`)."""
        t, heads, kv_heads, dim = h.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(_rms_norm(self.input_norm, self.input_eps, h))
        qk_end = (heads + kv_heads) * dim
        # Rotary on q and k together: x * cos + rotate_half(x) * sin.
        qk = qkv[:, :qk_end].view(t, heads + kv_heads, dim)
        half = dim // 2
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk = torch.addcmul(qk * cos, swapped, sin)
        k = qk[:, heads:].reshape(t * kv_heads, dim)
        v = qkv[:, qk_end:].reshape(t * kv_heads, dim)
        return qk[:, :heads], k, v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output `attended`: o_proj, then the MLP."""
        h = self.o_proj.add_to(h, attended)
        x = _rms_norm(self.post_norm, self.post_eps, h)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj.add_to(h, self.act_fn(gate) * up)


def _write_kv(
    keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store `k`, `v` `[r, dim]` at flat rows `rows` of a layer's slot buffers."""
    dim = keys.shape[-1]
    keys.view(-1, dim).index_copy_(0, rows, k.to(keys.dtype))
    values.view(-1, dim).index_copy_(0, rows, v.to(values.dtype))


class LlamaDecodeStep:
    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self._layers: list[_Layer] = []
        # cos and sin with the rotate-half sign folded in, per position: [positions, dim].
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        rotary = model.model.rotary_emb
        self._static_rope = getattr(rotary, "rope_type", "default") in _STATIC_ROPE
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused weights (and rotary table) from the model's current ones."""
        with torch.no_grad():
            self._layers = [
                _Layer(layer, self.heads, self.kv_heads, self.head_dim)
                for layer in self.model.model.layers
            ]
            norm = self.model.model.norm
            self._final_norm, self._final_eps = norm.weight, _eps(norm)
            head = self.model.lm_head
            self._lm_head = _Linear(head.weight, getattr(head, "bias", None))
        self._cos = self._sin = None

    def _rotary(self, h: torch.Tensor, pos: torch.Tensor, kv_len: int) -> tuple[Any, Any]:
        """cos, sin `[n, 1, dim]` for positions `pos` `[n, 1]`; sin's first half negated."""
        rotary = self.model.model.rotary_emb
        if not self._static_rope:
            cos, sin = rotary(h, position_ids=pos)
            return cos, _sign_sin(sin)
        if self._cos is None or self._cos.shape[0] < kv_len:
            # The table is the module's own output over all positions: elementwise, so
            # identical to calling it per step. Grows in chunks like the slot KV.
            size = max(kv_len, 2 * (self._cos.shape[0] if self._cos is not None else 128))
            every = torch.arange(size, device=pos.device).unsqueeze(0)
            cos, sin = rotary(h, position_ids=every)
            self._cos, self._sin = cos[0].contiguous(), _sign_sin(sin[0]).contiguous()
        at = pos[:, 0]
        assert self._sin is not None
        return self._cos[at].unsqueeze(1), self._sin[at].unsqueeze(1)

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
        cos, sin = self._rotary(h, pos, kv_len)
        # Where row r, KV head j writes its new K/V in a layer's buffer viewed as
        # [slots * kv_heads * capacity, dim]: one index_copy_ per tensor, shared by layers.
        cap = kv.k[0].shape[2]
        rows = torch.arange(n, device=ids.device).unsqueeze(1) * kv_heads
        heads_idx = torch.arange(kv_heads, device=ids.device).unsqueeze(0)
        write_idx = ((rows + heads_idx) * cap + pos).reshape(-1)
        # Additive mask per (row, KV head) block, the batch layout of the score bmm.
        mask3 = mask.reshape(n, 1, 1, kv_len).expand(n, kv_heads, 1, kv_len)
        mask3 = mask3.reshape(n * kv_heads, 1, kv_len)
        for i, layer in enumerate(self._layers):
            q, k, v = layer.project(h, cos, sin)
            _write_kv(kv.k[i], kv.v[i], write_idx, k, v)
            keys = kv.k[i][:n, :, :kv_len].reshape(n * kv_heads, kv_len, dim)
            values = kv.v[i][:n, :, :kv_len].reshape(n * kv_heads, kv_len, dim)
            # GQA: head h reads KV head h // group, so a group is a block of query rows.
            q3 = q.reshape(n * kv_heads, group, dim).to(keys.dtype)
            scores = torch.baddbmm(mask3, q3, keys.transpose(1, 2), alpha=layer.scaling)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            h = layer.finish(h, torch.bmm(probs, values).view(n, heads * dim).to(h.dtype))
        h = _rms_norm(self._final_norm, self._final_eps, h)
        return self._lm_head(h).float()

    def prefill(
        self,
        kv: SlotKV,
        first_row: int,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        mask: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """Logits `[k, vocab]` at the last column of `ids` `[k, width]` (left-padded) for
        rows `[first_row, first_row + k)`, whose K/V go to `write_pos` `[k, width]`;
        `pos` holds each token's position (padding: any valid one), `mask` is the additive
        `[k, 1, width, kv_len]` mask. Attention is SDPA, as in the HF forward."""
        inner = self.model.model
        k, width = ids.shape
        m = k * width
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        h = inner.embed_tokens(ids.reshape(m))  # [m, hidden]: tokens of all rows in a row
        cos, sin = self._rotary(h, pos.reshape(m, 1), kv_len)
        cap = kv.k[0].shape[2]
        rows = torch.arange(first_row, first_row + k, device=ids.device).view(k, 1, 1)
        heads_idx = torch.arange(kv_heads, device=ids.device).view(1, 1, kv_heads)
        # Token (r, t), KV head j -> the flat slot-buffer row; padding all lands on scratch.
        write_idx = ((rows * kv_heads + heads_idx) * cap + write_pos.unsqueeze(2)).reshape(-1)
        last_layer = len(self._layers) - 1
        for i, layer in enumerate(self._layers):
            q, new_k, new_v = layer.project(h, cos, sin)
            _write_kv(kv.k[i], kv.v[i], write_idx, new_k, new_v)
            q = q.view(k, width, heads, dim)
            if i == last_layer:
                # Every token's K/V is written; past this point only the last token of
                # each row feeds the logits, so the rest of the layer runs on k rows.
                q, mask, h = q[:, -1:], mask[:, :, -1:], h.view(k, width, -1)[:, -1]
            keys = kv.k[i][first_row : first_row + k, :, :kv_len]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(keys.dtype),
                keys,
                kv.v[i][first_row : first_row + k, :, :kv_len],
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=heads != kv_heads,
            )
            h = layer.finish(h, out.transpose(1, 2).reshape(h.shape[0], heads * dim).to(h.dtype))
        return self._lm_head(_rms_norm(self._final_norm, self._final_eps, h)).float()


def _sign_sin(sin: torch.Tensor) -> torch.Tensor:
    """`rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2)`: fold the sign into sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
