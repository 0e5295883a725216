"""Sampling and KV-store pieces of the local engine, on plain tensors."""

from __future__ import annotations

import torch

from agentflow.inference.kv_cache import SessionKV, SessionKVStore, SlotKV
from agentflow.inference.sampling import RowSampling, sample


def test_greedy_reports_unscaled_logprob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, logprobs = sample(logits, [RowSampling(0.0, 1.0, None)], torch.Generator())
    assert tokens == [1]
    assert abs(logprobs[0] - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6


def test_temperature_logprob_is_of_the_scaled_distribution():
    logits = torch.tensor([[0.5, 0.1, -0.3, 2.0]])
    tokens, logprobs = sample(logits, [RowSampling(0.5, 1.0, None)], torch.Generator())
    expected = torch.log_softmax(logits / 0.5, -1)[0, tokens[0]].item()
    assert abs(logprobs[0] - expected) < 1e-6


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        tokens, _ = sample(logits, [RowSampling(1.0, 0.75, None)], gen)
        seen.add(tokens[0])
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 never drawn
    seen_all = {sample(logits, [RowSampling(1.0, 1.0, None)], gen)[0][0] for _ in range(300)}
    assert seen_all == {0, 1, 2, 3}


def test_seeded_row_ignores_its_batch_mates():
    logits = torch.randn(3, 50)

    def seeded() -> RowSampling:
        return RowSampling(1.0, 1.0, torch.Generator().manual_seed(7))

    alone = sample(logits[:1], [seeded()], torch.Generator())[0]
    rows = [seeded(), RowSampling(1.0, 1.0, None), RowSampling(0.0, 1.0, None)]
    together = sample(logits, rows, torch.Generator().manual_seed(99))[0]
    assert together[0] == alone[0]


def test_session_store_evicts_least_recently_used():
    store = SessionKVStore(budget_tokens=10)

    def kv(n):
        return SessionKV(k=torch.zeros(1, 1, n, 2), v=torch.zeros(1, 1, n, 2))

    store.put("a", kv(4))
    store.put("b", kv(4))
    assert store.get("a") is not None  # "a" is now the most recent
    store.put("c", kv(4))  # 12 > 10: evicts "b"
    assert store.get("b") is None and store.get("a") is not None
    assert store.tokens == 8 and store.evictions == 1
    store.put("huge", kv(11))  # larger than the whole budget: not kept
    assert store.get("huge") is None and store.tokens == 8
    store.drop("a")
    assert store.tokens == 4 and len(store) == 1


def test_slot_kv_grows_keeps_data_and_moves_rows():
    kv = SlotKV(
        layers=2,
        slots=3,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        chunk=4,
    )
    kv.ensure(3)
    assert kv.capacity == 4 and kv.scratch == 3
    kv.k[0][1, 0, :3] = torch.arange(6.0).view(3, 2)
    kv.ensure(6)
    assert kv.capacity == 8
    assert torch.equal(kv.k[0][1, 0, :3], torch.arange(6.0).view(3, 2))
    kv.move(1, 0, 3)
    saved = kv.read(0, 3)
    assert torch.equal(saved.k[0, 0], torch.arange(6.0).view(3, 2)) and saved.length == 3
    kv.write(2, saved, 3)
    assert torch.equal(kv.k[0][2, 0, :3], kv.k[0][0, 0, :3])
