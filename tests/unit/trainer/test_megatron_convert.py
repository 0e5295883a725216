"""HF → Megatron layout → HF is exact, at every tensor/pipeline split, for each family.
(`tests/integration/trainer/megatron` checks the layout against megatron-core's modules.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mbridge")

from agentflow.errors import InvalidInput  # noqa: E402
from tests.support.megatron_models import FAMILIES, hf_config, hf_model  # noqa: E402
from trainer.backends.megatron.convert import (  # noqa: E402
    hf_bridge,
    megatron_names,
    merge_tp,
    padded_vocab_size,
    split_tp,
    to_hf,
    to_megatron,
)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact(family: str, tp: int, pp: int) -> None:
    model = hf_model(family)
    state = model.state_dict()
    bridge = hf_bridge(model.config, tp=tp, pp=pp)
    stages = to_megatron(state, bridge)
    assert len(stages) == pp and all(len(ranks) == tp for ranks in stages)
    back = to_hf(stages, bridge)
    if model.config.tie_word_embeddings:
        assert torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"])
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor), name


def test_pipeline_stages_hold_their_layers_numbered_from_zero() -> None:
    model = hf_model("qwen2")  # 4 layers
    stages = to_megatron(model.state_dict(), hf_bridge(model.config, tp=2, pp=2))
    first, last = stages[0][0], stages[1][0]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    layers = {int(name.split(".")[2]) for name in last if name.startswith("decoder.layers.")}
    assert layers == {0, 1}
    # Layer 2 of the model is the last stage's layer 0.
    torch.testing.assert_close(
        last["decoder.layers.0.input_layernorm.weight"],
        model.model.layers[2].input_layernorm.weight.detach(),
    )


def test_tied_embeddings_have_no_output_layer_on_one_stage() -> None:
    model = hf_model("llama")
    assert model.config.tie_word_embeddings
    one = hf_bridge(model.config)
    assert "output_layer.weight" not in megatron_names(one)
    two = to_megatron(model.state_dict(), hf_bridge(model.config, pp=2))
    # Several stages: the last keeps a copy of the (padded) embedding.
    torch.testing.assert_close(
        two[1][0]["output_layer.weight"], two[0][0]["embedding.word_embeddings.weight"]
    )


def test_vocabulary_is_padded_per_tensor_parallel_rank() -> None:
    assert padded_vocab_size(259, 1, 128) == 384
    assert padded_vocab_size(259, 2, 128) == 512
    assert padded_vocab_size(256, 2, 128) == 256
    model = hf_model("llama")  # vocabulary 259
    ranks = to_megatron(model.state_dict(), hf_bridge(model.config, tp=2))[0]
    embedding = [r["embedding.word_embeddings.weight"] for r in ranks]
    assert [tuple(e.shape) for e in embedding] == [(256, 64), (256, 64)]
    assert torch.count_nonzero(embedding[1][3:]) == 0  # rows past the vocabulary are zero


def test_fc1_ranks_each_hold_their_half_of_gate_and_up() -> None:
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = torch.cat([gate, up])
    parts = split_tp("decoder.layers.0.mlp.linear_fc1.weight", full, 2)
    assert torch.equal(parts[0], torch.cat([gate[:2], up[:2]]))
    assert torch.equal(parts[1], torch.cat([gate[2:], up[2:]]))
    assert torch.equal(merge_tp("decoder.layers.0.mlp.linear_fc1.weight", parts), full)
    proj = torch.arange(8.0).reshape(2, 4)
    row = split_tp("decoder.layers.0.self_attention.linear_proj.weight", proj, 2)
    assert [tuple(p.shape) for p in row] == [(2, 2), (2, 2)]


def test_refusals_name_the_field() -> None:
    from transformers import GPT2Config

    with pytest.raises(InvalidInput, match="not 'gpt2'") as gpt2:
        hf_bridge(GPT2Config())
    assert gpt2.value.field == ("model", "path")
    with pytest.raises(InvalidInput, match="does not divide the model's key/value heads") as tp:
        hf_bridge(hf_config("qwen2"), tp=4)  # 2 key/value heads
    assert tp.value.field == ("megatron", "tensor_parallel")
    with pytest.raises(InvalidInput, match="does not divide the model's 4 layers"):
        hf_bridge(hf_config("qwen2"), pp=3)
    state = hf_model("qwen2").state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InvalidInput, match="no model.layers.1.mlp.up_proj.weight"):
        to_megatron(state, hf_bridge(hf_config("qwen2")))
