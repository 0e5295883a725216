"""One rank of the Megatron layout check, run by `torchrun` (gloo, CPU) from
`test_convert_megatron.py`.

megatron-core's GPTModel cannot run a forward on CPU (its rotary embedding and attention
call CUDA), but it can be built there, and its linear layers run: so each rank builds the
real local-spec model at tensor-parallel size `TP`, loads its share of the converted HF
weights *strictly* (every name and shape must be the model's), and runs, on layer 0, the
attention's own q/k/v split and the whole MLP on a fixed input. Rank 0 writes what the
test compares against the HF model into `OUT/FAMILY.pt`, with every rank's state dict.
Last, the loss: each rank holds its vocabulary slice of the same logits, and the Megatron
backend's micro-batch loss (vocab-parallel log-probs) goes into `OUT/loss.pt`.

    torchrun --nproc_per_node=TP cpu_worker.py OUT TP FAMILY...
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")  # megatron-core's notes that Apex and TE are absent


def main(out: Path, tp: int, families: list[str]) -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    for family in families:
        check(out, family, tp)
    loss_check(out)
    # Both ranks are done before either tears down: a rank that exits while the other's
    # gloo threads still talk to it can abort that rank ("terminate called without an
    # active exception"), and megatron's own groups go before the default one.
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


LOSS_VOCAB = 300
TEMPERATURE = 0.7


def loss_inputs() -> tuple[torch.Tensor, object]:
    """Logits over the whole vocabulary and a micro-batch, the same in every process."""
    import random

    from tests.unit.trainer.test_batching import make_trajectory
    from trainer.batching import BatchingConfig, build_microbatches

    rng = random.Random(3)
    trajectories = [make_trajectory(rng.randrange(8, 20), rng) for _ in range(4)]
    advantages = [1.0, -0.5, 0.25, -1.0]
    (mb,) = build_microbatches(trajectories, advantages, BatchingConfig(), vocab_size=LOSS_VOCAB)
    generator = torch.Generator().manual_seed(5)
    rows, width = mb.input_ids.shape
    logits = torch.randn(rows, width, LOSS_VOCAB, generator=generator) * 3
    return logits, mb


def loss_check(out: Path) -> None:
    """The Megatron loss on this rank's vocabulary slice of the logits: its value, its
    metrics and the gradient of the whole logits (the ranks' slices gathered)."""
    from trainer.algorithms import AlgorithmConfig
    from trainer.backends.megatron.loss import microbatch_loss

    rank, tp = dist.get_rank(), dist.get_world_size()
    logits, mb = loss_inputs()
    width = LOSS_VOCAB // tp
    mine = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    algorithm = AlgorithmConfig(temperature=TEMPERATURE)
    loss, metrics, _ = microbatch_loss(mine, mb, algorithm, normalizer=50.0)
    loss.backward()
    grads = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(grads, mine.grad.contiguous())
    if rank == 0:
        grad = torch.cat(grads, dim=-1)
        torch.save({"loss": loss.detach(), "metrics": metrics, "grad": grad}, out / "loss.pt")


def check(out: Path, family: str, tp: int) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.support.megatron_models import hf_model
    from trainer.backends.megatron.convert import hf_bridge, to_megatron

    rank = dist.get_rank()
    model_hf = hf_model(family)
    bridge = hf_bridge(
        model_hf.config,
        tp=tp,
        use_cpu_initialization=True,
        sequence_parallel=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )
    config = bridge.config
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=config.qk_layernorm
        ),
        vocab_size=bridge.padded_vocab_size,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=bool(model_hf.config.tie_word_embeddings),
    )
    shard = to_megatron(model_hf.state_dict(), bridge)[0][rank]
    model.load_state_dict(shard, strict=False)
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert own == set(shard), sorted(own ^ set(shard))  # strict, less TE's extra state

    torch.manual_seed(1)
    hidden = torch.randn(5, 1, config.hidden_size)  # [s, b, h], the same on every rank
    layer = model.decoder.layers[0]
    with torch.no_grad():
        q, k, v = layer.self_attention.get_query_key_value_tensors(hidden)[:3]
        mlp, _ = layer.mlp(hidden)
    # Each rank holds its query groups' heads: gather them along the head dim (megatron's
    # own gather asks for a CUDA device).
    q, k, v = (_gather_heads(t) for t in (q, k, v))
    if rank == 0:
        states = [None] * tp
    else:
        states = None
    dist.gather_object(
        {k: t.detach().clone() for k, t in model.state_dict().items() if torch.is_tensor(t)},
        states,
        dst=0,
    )
    if rank == 0:
        torch.save(
            {"hidden": hidden, "q": q, "k": k, "v": v, "mlp": mlp, "states": states},
            out / f"{family}.pt",
        )


def _gather_heads(local: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=2)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
