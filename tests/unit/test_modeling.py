from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from agentflow.errors import InvalidInput
from agentflow.modeling import ModelInit, build_model, load_model, save_model, score
from agentflow.tokenization import ByteTokenizer

TINY = ModelInit(layers=2, hidden=32, heads=4, kv_heads=2, max_context=64)


def test_build_is_seeded_and_sized():
    a, b, c = build_model(TINY, seed=1), build_model(TINY, seed=1), build_model(TINY, seed=2)
    assert a.config.vocab_size == ByteTokenizer().vocab_size == TINY.vocab_size
    assert a.config.num_key_value_heads == 2 and a.config.max_position_embeddings == 64
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_build_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    build_model(TINY, seed=5)
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.parametrize(
    "bad",
    [
        {"hidden": 30, "heads": 4},  # not divisible
        {"heads": 4, "kv_heads": 3},
        {"layers": 0},
        {"tokenizer": "gpt2"},
        {"unknown": 1},
    ],
)
def test_init_validation(bad):
    with pytest.raises(ValidationError):
        ModelInit(**{"hidden": 32, "heads": 4, **bad})


def test_save_and_load_round_trip(tmp_path):
    model = build_model(TINY, seed=3)
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    ids = [1, 2, 3, 4, 5]
    assert score(loaded, ids) == score(model, ids)
    assert loaded.config.agentflow_init["tokenizer"] == "bytes"
    with pytest.raises(InvalidInput):
        load_model(tmp_path / "absent")


def test_score_temperatures():
    model = build_model(TINY, seed=0)
    ids = [5, 6, 7, 8]
    logits = model(input_ids=torch.tensor([ids])).logits[0].detach()
    for temp in (1.0, 0.5):
        expected = torch.log_softmax(logits[:-1] / temp, -1).gather(1, torch.tensor([ids[1:]]).T)
        assert torch.allclose(torch.tensor(score(model, ids, temp)), expected.squeeze(1), atol=1e-6)
    assert score(model, ids, 0.0) == score(model, ids, 1.0)  # 0: unscaled
    assert score(model, ids, start=4) == []
    with pytest.raises(InvalidInput):
        score(model, ids, start=0)


# A fresh interpreter: transformers resolves its top-level names lazily, and the race
# is in the first resolution of each name.
_SCRIPT = """
import threading
from agentflow.modeling import import_model_classes
errors = []
def build():
    try:
        import_model_classes()
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=build) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
"""


def test_model_classes_import_safely_from_concurrent_threads() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
