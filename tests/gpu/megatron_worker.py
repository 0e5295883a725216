"""One rank of the Megatron backend's GPU check, run by torchrun from `test_megatron_gpu.py`.

On the same HF weights (a Qwen2-shaped model, fp32, TF32 off), per-token log-probs of the
Megatron backend and of the torch backend; then optimizer steps on one batch of the
Megatron backend, whose loss must fall. Rank 0 writes what it measured to `OUT/result.json`.

    torchrun --nproc_per_node=N tests/gpu/megatron_worker.py OUT TP
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path, tp: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    local = int(__import__("os").environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")

    from tests.support.megatron_models import hf_model
    from tests.unit.trainer.test_batching import make_trajectory
    from trainer.algorithms import AlgorithmConfig
    from trainer.backends.megatron.policy import MegatronBackendConfig, MegatronPolicy
    from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
    from trainer.batching import BatchingConfig, build_microbatches

    model = hf_model("qwen2")
    rng = random.Random(0)
    trajectories = [make_trajectory(rng.randrange(10, 40), rng) for _ in range(8)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(8)]
    batching = BatchingConfig(max_tokens_per_microbatch=4096)
    (mb,) = build_microbatches(trajectories, advantages, batching, vocab_size=300)

    megatron = MegatronPolicy(
        model,
        MegatronBackendConfig(tensor_parallel=tp, precision="fp32", batching=batching, lr=1e-3),
    )
    reference = TorchPolicy(hf_model("qwen2"), TorchBackendConfig(device=f"cuda:{local}"))
    valid = mb.target_valid
    ours = megatron.logprobs(mb, temperature=0.8)[valid]
    theirs = reference.logprobs(mb, temperature=0.8).cpu()[valid]
    max_diff = float((ours - theirs).abs().max())

    algorithm = AlgorithmConfig(temperature=1.0)
    losses, norms = [], []
    for _ in range(5):
        metrics = megatron.train_step(trajectories, advantages, algorithm)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    hf_after = megatron.state_dict()  # every rank takes part
    if dist.get_rank() == 0:
        result = {
            "logprob_max_abs_diff": max_diff,
            "positions": int(valid.sum()),
            "losses": losses,
            "grad_norms": norms,
            "exported_names": sorted(hf_after),
        }
        (out / "result.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
