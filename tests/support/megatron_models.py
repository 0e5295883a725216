"""Tiny HF checkpoints of each family the Megatron backend converts (random init)."""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "llama":  # tied embeddings, a vocabulary that needs padding
        return LlamaConfig(vocab_size=259, tie_word_embeddings=True, **shape)
    if family == "qwen2":  # untied, q/k/v biases
        return Qwen2Config(vocab_size=300, tie_word_embeddings=False, **shape)
    # qwen3: q/k norms and a head dim that is not hidden / heads
    return Qwen3Config(vocab_size=300, tie_word_embeddings=False, head_dim=32, **shape)


def hf_model(family: str, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(family))
        # Non-trivial norms and biases, so a misplaced one cannot pass as ones or zeros.
        for param in model.parameters():
            if param.dim() == 1:
                param.data.uniform_(0.5, 1.5)
    return model.eval()
