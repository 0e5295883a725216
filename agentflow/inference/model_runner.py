"""The compute side of the local engine: one batched step of an HF causal LM over slots.

`ModelRunner.step(plan)` runs in the engine's single worker thread and touches only the
model, the KV memory and the plan it was handed; the scheduler (on the event loop)
decides what goes into each plan. A step:

1. saves the KV of session requests that just finished into the session store,
2. fills holes left by finished rows with rows from the end (one row copy each),
3. decodes one token for every running row (`[0, n_running)`) in one forward pass,
4. prefills joining requests (rows after them), left-padded in one forward pass,
   loading a parent's cached KV first so only the uncached suffix is computed,
5. samples one token per row,
6. keeps decoding all rows for up to `plan.burst - 1` more steps while no row has
   finished and nobody asked for the lock (`interrupt`): this saves the event-loop round
   trip per token, which on small models costs as much as the forward pass.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from agentflow.errors import EngineRequestError
from agentflow.inference import attention
from agentflow.inference.fast_decode import LlamaDecodeStep
from agentflow.inference.fast_decode import supports as fast_decode_supports
from agentflow.inference.kv_cache import SessionKVStore, SlotKV
from agentflow.inference.sampling import sample_with_tops
from agentflow.inference.step_plan import Join, StepOutput, StepPlan


class ModelRunner:
    def __init__(
        self,
        model: Any,
        *,
        slots: int,
        kv_budget_tokens: int,
        seed: int = 0,
        fast_decode: bool = True,
        fast_prefill: bool = True,
    ) -> None:
        self.model = model
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        heads = cfg.num_attention_heads
        self.kv = SlotKV(
            layers=cfg.num_hidden_layers,
            slots=slots,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            dtype=self.dtype,
            device=self.device,
        )
        self.store = SessionKVStore(kv_budget_tokens)
        self._attention = attention.register()
        self._cache_kwarg = _cache_kwarg(model)
        self._fast = LlamaDecodeStep(model) if fast_decode and fast_decode_supports(model) else None
        # Prefill through the same lean layers (else through the HF forward).
        self.fast_prefill = fast_prefill
        self.shared_generator = torch.Generator().manual_seed(seed)
        # Only the worker thread runs steps, but update/close may come from elsewhere.
        self.lock = threading.Lock()
        # Set by the scheduler when something waits for the step to end (a join, a pause).
        self.interrupt = threading.Event()

    # -- one step -----------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepOutput:
        with self.lock, torch.inference_mode():
            for rid, slot, length in plan.saves:
                self.store.put(rid, self.kv.read(slot, length))
            for src, dst, length in plan.moves:
                self.kv.move(src, dst, length)
            n = len(plan.decode_tokens)
            logits: list[torch.Tensor] = []
            if n:
                logits.append(self._decode(plan.decode_tokens, plan.decode_pos))
            cached: list[int] = []
            if plan.joins:
                join_logits, cached = self._prefill(n, plan.joins)
                logits.append(join_logits)
            if not logits:
                return StepOutput([], [], [])
            tokens, logprobs, tops = sample_with_tops(
                torch.cat(logits), plan.sampling, self.shared_generator
            )
            out = StepOutput([tokens], [logprobs], cached, [tops])
            positions = [p + 1 for p in plan.decode_pos] + [len(j.context) for j in plan.joins]
            for step in range(1, plan.burst):
                if self.interrupt.is_set() or any(
                    tok in plan.stops[i] or step >= plan.limits[i] for i, tok in enumerate(tokens)
                ):
                    break
                logits_n = self._decode(tokens, positions)
                tokens, logprobs, tops = sample_with_tops(
                    logits_n, plan.sampling, self.shared_generator
                )
                out.tokens.append(tokens)
                out.logprobs.append(logprobs)
                out.tops.append(tops)
                positions = [p + 1 for p in positions]
            return out

    def _forward(
        self,
        rows: slice,
        ids: torch.Tensor,
        pos: torch.Tensor,
        write_pos: torch.Tensor,
        allowed: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        mask = self._additive_mask(allowed)
        cfg = self.model.config
        previous = cfg._attn_implementation
        # Only for this call: teacher forcing on the same model keeps its own attention.
        cfg._attn_implementation = self._attention
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask.unsqueeze(1),  # 4D: HF uses a prepared mask as is
                position_ids=pos,
                use_cache=True,
                **{self._cache_kwarg: self.kv.step_cache(rows, write_pos, kv_len)},
                logits_to_keep=1,
            )
        finally:
            cfg._attn_implementation = previous
        return out.logits[:, -1, :].float()

    def _additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """0 where `allowed`, the dtype's minimum elsewhere (what attention adds to scores)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        dev = self.device
        n = len(tokens)
        pos = torch.tensor(positions, dtype=torch.long, device=dev).unsqueeze(1)  # [n, 1]
        kv_len = max(positions) + 1
        self.kv.ensure(kv_len)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev).unsqueeze(1)
        if self._fast is not None:
            # The same additive mask as `_forward` builds (0 allowed, dtype min not), in
            # two ops: the step is short enough that each op counts.
            future = torch.arange(kv_len, device=dev).unsqueeze(0) > pos  # [n, kv_len]
            mask = torch.where(future, torch.finfo(self.dtype).min, 0.0).to(self.dtype)
            return self._fast(self.kv, ids, pos, mask.view(n, 1, 1, kv_len), kv_len)
        allowed = torch.arange(kv_len, device=dev).view(1, 1, -1) <= pos.unsqueeze(2)
        return self._forward(slice(0, n), ids, pos, pos, allowed, kv_len)

    def _prefill(self, first_row: int, joins: list[Join]) -> tuple[torch.Tensor, list[int]]:
        cached: list[int] = []
        for j in joins:
            kv = self.store.get(j.load_rid) if j.load_rid is not None else None
            c = min(kv.length, j.load_max, len(j.context) - 1) if kv is not None else 0
            if c > 0:
                assert kv is not None
                self.kv.ensure(c)
                self.kv.write(j.slot, kv, c)
            cached.append(c)
        new = [j.context[c:] for j, c in zip(joins, cached, strict=True)]
        width = max(len(t) for t in new)
        kv_len = max(c + len(t) for c, t in zip(cached, new, strict=True))
        self.kv.ensure(kv_len)
        dev = self.device
        k = len(joins)
        ids = torch.full((k, width), 0, dtype=torch.long)
        qpos = torch.full((k, width), -1, dtype=torch.long)  # -1: left padding
        for i, (c, t) in enumerate(zip(cached, new, strict=True)):
            pad = width - len(t)
            ids[i, pad:] = torch.tensor(t, dtype=torch.long)
            qpos[i, pad:] = torch.arange(c, c + len(t))
        ids, qpos = ids.to(dev), qpos.to(dev)
        padded = qpos < 0
        write_pos = qpos.masked_fill(padded, self.kv.scratch)
        keys = torch.arange(kv_len, device=dev).view(1, 1, -1)
        # Padding rows attend to position 0 only: any finite row avoids NaN, and is discarded.
        allowed = (keys <= qpos.unsqueeze(2)) | (padded.unsqueeze(2) & (keys == 0))
        if self._fast is not None and self.fast_prefill:
            mask = self._additive_mask(allowed).unsqueeze(1)
            logits = self._fast.prefill(
                self.kv, first_row, ids, qpos.clamp(min=0), write_pos, mask, kv_len
            )
            return logits, cached
        rows = slice(first_row, first_row + k)
        logits = self._forward(rows, ids, qpos.clamp(min=0), write_pos, allowed, kv_len)
        return logits, cached

    # -- weights ------------------------------------------------------------------------

    def load_weights(self, state_dict: Any | None, path: str | None) -> None:
        """Copy new weights in place, after checking every name and shape (all or nothing)."""
        sd = dict(state_dict) if state_dict is not None else _read_safetensors_dir(path or "")
        with self.lock, torch.no_grad():
            # Tied weights appear under both names in a state dict: accept either.
            params = dict(self.model.named_parameters(remove_duplicate=False))
            params.update(dict(self.model.named_buffers(remove_duplicate=False)))
            unknown = sorted(set(sd) - set(params))
            if unknown:
                raise EngineRequestError(f"weights name unknown parameters: {unknown[:5]}")
            tie = getattr(self.model.config, "tie_word_embeddings", False)
            tied = {"lm_head.weight"} if tie else set()
            named = {n for n, _ in self.model.named_parameters()}
            missing = sorted(named - set(sd) - tied)
            if missing:
                raise EngineRequestError(f"weights miss parameters: {missing[:5]}")
            for name, value in sd.items():
                if tuple(value.shape) != tuple(params[name].shape):
                    raise EngineRequestError(
                        f"weight {name} has shape {tuple(value.shape)}, "
                        f"expected {tuple(params[name].shape)}"
                    )
            for name, value in sd.items():
                params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
            if self._fast is not None:
                self._fast.refresh()


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; earlier ones `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineRequestError(f"no .safetensors files in {path!r}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
