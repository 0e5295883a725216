"""KV memory of the local engine: one batched slot buffer for running requests, plus an
LRU store of finished session caches under a token budget.

`SlotKV` holds, per layer, K and V as `[slots, kv_heads, capacity, head_dim]`. Each running
request owns one slot (a row) and its own length, so a decode step writes each row's new
K/V at that row's position and attends over the common prefix `[:max_len]` with a mask:
no per-step copying of caches, which is what makes batched decode fast on CPU. Rows are
kept contiguous (`[0, n)`) by moving the last row into a hole when a request leaves, so
the batch is always a view, never a gather.

`_StepCache` adapts one forward pass to the HF `Cache.update` call that every
Llama-family attention layer makes; the caller passes a ready 4D mask, which HF uses
as is.

The last column of the buffer is scratch: left-padding positions of a batched prefill
write there, so they never overwrite a real token's K/V.

The buffer holds every slot (`max_batch_size`) and grows in chunks of positions to the
longest context seen; it is not shrunk, so a step never pays for reallocating it. Its
size is `2 * layers * slots * kv_heads * capacity * head_dim` elements.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


class SlotKV:
    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int = 256,
    ) -> None:
        self.layers, self.slots, self.kv_heads, self.head_dim = layers, slots, kv_heads, head_dim
        self.dtype, self.device, self.chunk = dtype, device, chunk
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def scratch(self) -> int:
        return self.capacity - 1

    def ensure(self, length: int) -> None:
        """Make room for `length` real positions (+ the scratch column)."""
        need = length + 1
        if need <= self.capacity:
            return
        cap = (need + self.chunk - 1) // self.chunk * self.chunk
        shape = (self.slots, self.kv_heads, cap, self.head_dim)

        # zeros, not empty: masked positions still enter the matmul, NaN garbage would leak.
        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        new_k = [zeros() for _ in range(self.layers)]
        new_v = [zeros() for _ in range(self.layers)]
        keep = self.capacity - 1 if self.capacity else 0
        for i in range(len(self.k)):
            new_k[i][:, :, :keep] = self.k[i][:, :, :keep]
            new_v[i][:, :, :keep] = self.v[i][:, :, :keep]
        self.k, self.v, self.capacity = new_k, new_v, cap

    def move(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def read(self, slot: int, length: int) -> SessionKV:
        """A copy of a slot's first `length` positions (to outlive the slot)."""
        k = torch.stack([k[slot, :, :length] for k in self.k]).clone()
        v = torch.stack([v[slot, :, :length] for v in self.v]).clone()
        return SessionKV(k=k, v=v)

    def write(self, slot: int, kv: SessionKV, length: int) -> None:
        for i in range(self.layers):
            self.k[i][slot, :, :length] = kv.k[i, :, :length]
            self.v[i][slot, :, :length] = kv.v[i, :, :length]

    def step_cache(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> _StepCache:
        return _StepCache(self, rows, write_pos, kv_len)


class _StepCache:
    """What HF attention layers see during one forward over rows `rows` of a `SlotKV`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, kv: SlotKV, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        self._kv, self._rows, self._pos, self._len = kv, rows, write_pos, kv_len
        start = rows.start or 0
        n = write_pos.shape[0]
        self._row_idx = torch.arange(start, start + n, device=write_pos.device).unsqueeze(1)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._kv.k[layer_idx], self._kv.v[layer_idx]
        # [n, H, T, D] -> [n, T, H, D]: the layout advanced indexing (rows, :, pos) yields.
        k[self._row_idx, :, self._pos] = key_states.transpose(1, 2).to(k.dtype)
        v[self._row_idx, :, self._pos] = value_states.transpose(1, 2).to(v.dtype)
        return k[self._rows, :, : self._len], v[self._rows, :, : self._len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._len


@dataclass
class SessionKV:
    """K and V of one finished request's context, `[layers, kv_heads, length, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])


class SessionKVStore:
    """Finished requests' KV keyed by rid, least recently used evicted past `budget_tokens`.

    An evicted entry only loses its tensors: the engine keeps every rid's token ids, so a
    child request recomputes the prefix instead of failing.
    """

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self._entries: OrderedDict[str, SessionKV] = OrderedDict()
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, kv: SessionKV) -> None:
        self.drop(rid)
        if kv.length > self.budget_tokens:
            self.evictions += 1
            return
        self._entries[rid] = kv
        self.tokens += kv.length
        while self.tokens > self.budget_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.length
            self.evictions += 1

    def get(self, rid: str) -> SessionKV | None:
        kv = self._entries.get(rid)
        if kv is not None:
            self._entries.move_to_end(rid)
        return kv

    def drop(self, rid: str) -> None:
        old = self._entries.pop(rid, None)
        if old is not None:
            self.tokens -= old.length

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
