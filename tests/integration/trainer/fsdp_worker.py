"""One rank of the FSDP2 check, run by `torchrun` from `test_fsdp.py` (gloo, CPU).

Every rank builds the same model and batch, trains one step on its own share of the
batch (rank 0 a larger one, so the ranks run different numbers of micro-batches), and
gathers the full state; rank 0 writes what the test compares into `OUT/result.pt`.
Then the checkpoint path: all ranks save (rank 0 writes), train on, and load it back.
Last, a step on a batch smaller than the ranks: rank 0 trains one trajectory, rank 1 is
idle (`train_step(idle=True)`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from agentflow.modeling import ModelInit, build_model
from agentflow.types import Trajectory
from tests.unit.trainer.test_batching import make_trajectory
from tests.unit.trainer.test_torch_backend import _on_policy
from trainer.algorithms import group_advantages
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
from trainer.batching import BatchingConfig

TINY = ModelInit(layers=2, hidden=32, heads=2)
CONFIG = TorchBackendConfig(lr=1e-3, batching=BatchingConfig(max_tokens_per_microbatch=120))
BATCH = 12
SHARES = (range(0, 8), range(8, 12))  # rank -> trajectory indices


def batch() -> tuple[list[Trajectory], list[float]]:
    """The same trajectories and advantages in every process."""
    model = build_model(TINY, seed=0)
    rng = random.Random(7)
    trajs = [
        make_trajectory(rng.randrange(10, 50), rng, group=f"g{i // 4}", reward=float(i % 3 == 0))
        for i in range(BATCH)
    ]
    trajs = _on_policy(model, trajs, 1.0)
    adv = group_advantages([t.reward or 0.0 for t in trajs], [t.group_id for t in trajs])
    return trajs, adv


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    trajs, adv = batch()
    share = SHARES[rank]
    policy = TorchPolicy(build_model(TINY, seed=0), CONFIG)
    assert policy.sharded
    metrics = policy.train_step([trajs[i] for i in share], [adv[i] for i in share])
    every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, metrics)
    state = policy.state_dict()  # every rank takes part in the gather

    checkpoint = out / "checkpoint"
    policy.save_checkpoint(checkpoint, step=1, weight_version=1)
    dist.barrier()  # rank 0 has written it
    policy.train_step([trajs[i] for i in share], [adv[i] for i in share])
    moved = policy.state_dict()
    policy.load_checkpoint(checkpoint)
    restored = policy.state_dict()
    # A batch smaller than the ranks: rank 0 trains one trajectory, rank 1 is idle.
    alone = policy.train_step([trajs[rank]], [adv[rank]], idle=rank == 1)
    idle_step: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(idle_step, alone)
    after_idle = policy.state_dict()
    if rank == 0:
        torch.save(
            {
                "metrics": every,
                "state": state,
                "moved": any(not torch.equal(moved[k], state[k]) for k in state),
                "restored": all(torch.equal(restored[k], state[k]) for k in state),
                "idle_step": idle_step,
                "after_idle": after_idle,
            },
            out / "result.pt",
        )
    # Leave together: a rank that tears its group down while the other still writes can
    # abort in gloo's threads ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
