"""HF ⇄ Megatron-core weights for Llama-, Qwen2- and Qwen3-family checkpoints.

    bridge = hf_bridge(hf_config, tp=2, pp=1)
    stages = to_megatron(hf_state, bridge)       # [pp stage][tp rank] -> that rank's state dict
    hf_state = to_hf(stages, bridge)             # and back, exactly

The per-tensor conversion is mbridge's (`AutoBridge`): q/k/v fused into `linear_qkv`
group by group (each query group's q heads, then its k and its v head), gate and up into
`linear_fc1`, the vocabulary padded to a multiple of `divisible_by * tp`. What mbridge
leaves to its model object is done here, so it runs without one (and without CUDA):

- the names of Megatron's *local* layer spec, which the backend uses so that Transformer
  Engine is not required: its norms are modules of their own (`input_layernorm`,
  `pre_mlp_layernorm`) where Transformer Engine's spec, which mbridge names, fuses them
  into the next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
- the tensor-parallel split and merge: column-parallel layers (`linear_qkv`, `linear_fc1`,
  the embedding and the output layer) split along rows, row-parallel ones (`linear_proj`,
  `linear_fc2`) along columns, norms are replicated; `linear_fc1` splits gate and up
  separately, so each rank holds its own half of both;
- pipeline stages: each holds `num_layers / pp` layers numbered from 0 on that stage, the
  embedding on the first, the final norm and output layer on the last. With tied
  embeddings a single stage has no output layer; with several the last keeps a copy
  (Megatron keeps the two in step), which `to_hf` ignores.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from agentflow.errors import InvalidInput

if TYPE_CHECKING:
    import torch

FAMILIES = ("llama", "qwen2", "qwen3")
DEFAULT_VOCAB_DIVISIBLE_BY = 128

# Local spec name → the Transformer Engine name mbridge maps (the norms TE fuses).
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.", "mlp.linear_fc1.")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def hf_bridge(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype | None = None,
    divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    **transformer_overrides: Any,
) -> Any:
    """An mbridge bridge for `hf_config` at these parallel sizes, its vocabulary padding set.

    `transformer_overrides` go into its `TransformerConfig` (mbridge's `set_extra_args`).
    Refuses, naming the field, a model family or a shape these sizes cannot split."""
    import torch

    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise InvalidInput(
            f"the Megatron backend converts {', '.join(FAMILIES)} checkpoints, not {family!r}",
            field=("model", "path"),
        )
    groups = hf_config.num_key_value_heads or hf_config.num_attention_heads
    for what, value in (
        ("key/value heads", groups),
        ("MLP width", hf_config.intermediate_size),
    ):
        if value % tp:
            raise InvalidInput(
                f"tensor parallel size {tp} does not divide the model's {what} ({value})",
                field=("megatron", "tensor_parallel"),
            )
    if hf_config.num_hidden_layers % pp:
        raise InvalidInput(
            f"pipeline parallel size {pp} does not divide the model's "
            f"{hf_config.num_hidden_layers} layers",
            field=("megatron", "pipeline_parallel"),
        )
    with quiet_megatron():
        from mbridge import AutoBridge
        from mbridge.core.parallel_states import ParallelStates

        states = ParallelStates(tp_size=tp, pp_size=pp, vpp_size=None)
        bridge = AutoBridge.from_config(
            hf_config,
            dtype=dtype or torch.float32,
            parallel_states=states,
            make_vocab_size_divisible_by=divisible_by,
        )
        if transformer_overrides:
            bridge.set_extra_args(**transformer_overrides)
    bridge.vocab_size = hf_config.vocab_size
    bridge.padded_vocab_size = padded_vocab_size(hf_config.vocab_size, tp, divisible_by)
    return bridge


@contextmanager
def quiet_megatron() -> Iterator[None]:
    """megatron-core and mbridge warn at import and config time that Apex and Transformer
    Engine are absent (the local spec does not use them) and about their own deprecations."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\b")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|mbridge)\b")
        yield


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def tied(bridge: Any) -> bool:
    return bool(getattr(bridge.hf_config, "tie_word_embeddings", False))


def megatron_names(bridge: Any) -> list[str]:
    """Every parameter of the local-spec GPTModel, with global layer numbers, in order."""
    config = bridge.config
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if config.add_qkv_bias:
        per_layer.append("self_attention.linear_qkv.bias")
    if config.qk_layernorm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    per_layer += [
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]
    names = ["embedding.word_embeddings.weight"]
    for layer in range(config.num_layers):
        names += [f"decoder.layers.{layer}.{suffix}" for suffix in per_layer]
    names.append("decoder.final_layernorm.weight")
    if not tied(bridge) or bridge.mpu.pp_size > 1:
        names.append("output_layer.weight")
    return names


def _hf_names(bridge: Any, name: str) -> list[str]:
    """The HF tensors one Megatron tensor is made of (mbridge's map, in TE names)."""
    if name == "output_layer.weight":  # not mbridge's map: it edits it on the class
        return ["model.embed_tokens.weight" if tied(bridge) else "lm_head.weight"]
    return list(bridge._weight_name_mapping_mcore_to_hf(_te_name(name)))


def _te_name(name: str) -> str:
    match = _LAYER.match(name)
    if match and match.group(2) in _LOCAL_TO_TE:
        return f"decoder.layers.{match.group(1)}.{_LOCAL_TO_TE[match.group(2)]}"
    return name


def _stage_of(bridge: Any, name: str) -> tuple[list[int], str]:
    """The pipeline stages holding `name` and its name there (layers renumbered)."""
    pp = bridge.mpu.pp_size
    per_stage = bridge.config.num_layers // pp
    match = _LAYER.match(name)
    if match:
        layer = int(match.group(1))
        return [layer // per_stage], f"decoder.layers.{layer % per_stage}.{match.group(2)}"
    if name == "embedding.word_embeddings.weight":
        return [0], name
    return [pp - 1], name


def split_tp(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """One full Megatron tensor → each tensor-parallel rank's part."""
    import torch

    if tp == 1:
        return [tensor]
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    if any(part in name for part in _COLUMN_PARALLEL) or name in _VOCAB_PARALLEL:
        return list(tensor.chunk(tp))
    if name.endswith(_ROW_PARALLEL):
        return list(tensor.chunk(tp, dim=1))
    return [tensor] * tp  # norms: every rank holds all of it


def merge_tp(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor-parallel rank's part → the full Megatron tensor (`split_tp` undone)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [part.chunk(2) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if any(part in name for part in _COLUMN_PARALLEL) or name in _VOCAB_PARALLEL:
        return torch.cat(list(parts))
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(list(parts), dim=1)
    return parts[0]


def to_megatron(
    hf_state: Mapping[str, torch.Tensor], bridge: Any
) -> list[list[dict[str, torch.Tensor]]]:
    """HF tensors → `[pp stage][tp rank]` state dicts of the local-spec GPTModel."""
    tp, pp = bridge.mpu.tp_size, bridge.mpu.pp_size
    stages: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(tp)] for _ in range(pp)]
    for name in megatron_names(bridge):
        sources = _hf_names(bridge, name)
        missing = [n for n in sources if n not in hf_state]
        if missing:
            raise InvalidInput(f"the checkpoint has no {missing[0]}", field=("model", "path"))
        full = bridge._weight_to_mcore_format(_te_name(name), [hf_state[n] for n in sources])
        held_by, local = _stage_of(bridge, name)
        for stage in held_by:
            for rank, part in enumerate(split_tp(name, full, tp)):
                stages[stage][rank][local] = part.contiguous()
    return stages


def to_hf(
    stages: Sequence[Sequence[Mapping[str, torch.Tensor]]], bridge: Any
) -> dict[str, torch.Tensor]:
    """`[pp stage][tp rank]` local-spec state dicts → HF tensors (`to_megatron` undone)."""
    out: dict[str, torch.Tensor] = {}
    for name in megatron_names(bridge):
        if tied(bridge) and name == "output_layer.weight":
            continue  # the last stage's copy of the embedding
        held_by, local = _stage_of(bridge, name)
        full = merge_tp(name, [rank_state[local] for rank_state in stages[held_by[0]]])
        if name in _VOCAB_PARALLEL:
            out[_hf_names(bridge, name)[0]] = full[: bridge.vocab_size]  # padding dropped
            continue
        hf_names, tensors = bridge._weight_to_hf_format(_te_name(name), full)
        out.update(zip(hf_names, tensors, strict=True))
    return out
