"""Several trainer processes (`trainer.ranks > 1`): FSDP2 over torchrun, one rank leasing.

    agentflow trainer CONFIG --gateway URL      # with trainer.ranks = N

`agentflow trainer` starts torchrun with N copies of itself (`launch`); inside, every rank
builds the same policy (an FSDP2-sharded `TorchPolicy`, or a `MegatronPolicy`). Only rank
0 talks to the gateway: it leases, computes advantages (they need whole groups), scores
with teachers, publishes, checkpoints and acknowledges, running the ordinary train loop
on a `LeaderPolicy`. Each call of that policy that the ranks must make together (a train
step, a state dict, a checkpoint save or load) is sent to the other ranks (`follow`) as a
command, so they run the same collectives in the same order, and nothing else reaches
them: no rank but 0 leases, so each trajectory is trained once, on one data-parallel rank.

A step's batch is split between the data-parallel ranks by tokens (`shares`: longest
first, each to the rank with the fewest tokens so far; the tensor- and pipeline-parallel
ranks of one Megatron replica share its part). Each rank's loss is already divided by the
whole batch's policy-token count, so the ranks' gradients add up to the batch's, and the
ranks' metrics are combined into the batch's (`combine`). A batch with fewer trajectories
than ranks leaves some ranks idle: they run one trajectory with no weight, as the
collectives need every rank.

A rank that fails ends the job: torchrun stops the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from agentflow.errors import InvalidInput
from agentflow.types import Trajectory
from trainer.batching import Advantage

if TYPE_CHECKING:
    from agentflow.run_config import RunConfig
    from trainer.backends.base import Policy

# Rank 0 may wait long for rollouts between two commands; a shorter timeout would end the
# job while the other ranks wait for the next one.
RANK_TIMEOUT = timedelta(hours=24)

# Metrics each rank reports for its own share, added up; and those every rank has alike.
_SUMMED = {"tokens", "policy_tokens", "trajectories", "microbatches", "loss"}
_SLOWEST = {"seconds", "batching_seconds", "no_grad_pass_seconds"}
_SHARED = {"grad_norm", "lr", "optimizer_steps", "skipped_steps"}


def in_ranks() -> bool:
    """Whether this process is a torchrun rank (`launch` started it)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_ranks(config: RunConfig) -> bool:
    """Whether `agentflow trainer` runs this config under torchrun: several ranks, or the
    Megatron backend (which needs a process group even alone)."""
    return config.trainer.ranks > 1 or config.trainer.backend == "megatron"


ARGV_ENV = "AGENTFLOW_RANK_ARGV"


def launch(ranks: int, module: str, argv: Sequence[str]) -> int:
    """Run `python -m MODULE` (the `agentflow` command) as `ranks` torchrun processes on
    this machine, each given `argv`; their exit code.

    The arguments travel in the environment (`ARGV_ENV`): torchrun's own parser would
    read `--run` as an abbreviation of one of its options."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        module,
    ]
    env = {**os.environ, ARGV_ENV: json.dumps(list(argv))}
    return subprocess.run(command, env=env, check=False).returncode


def join(device: str, ranks: int) -> str:
    """Join the job's process group (NCCL on CUDA, gloo on CPU); this rank's device."""
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != ranks:
        raise InvalidInput(
            f"torchrun started {world} ranks and trainer.ranks is {ranks}",
            field=("trainer", "ranks"),
        )
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=RANK_TIMEOUT)
        return f"cuda:{local}"
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    return "cpu"


def shares(trajectories: Sequence[Trajectory], world: int) -> list[list[int]]:
    """Trajectory indices per rank, balanced by tokens (longest first, to the lightest)."""
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    order = sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i].token_ids))
    for i in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        out[rank].append(i)
        loads[rank] += len(trajectories[i].token_ids)
    return [sorted(share) for share in out]


def combine(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """The batch's metrics from each rank's for its share (see the module docstring)."""
    worked = [m for m in per_rank if m.get("policy_tokens", 0.0) > 0] or list(per_rank)
    tokens = sum(m.get("policy_tokens", 0.0) for m in worked)
    out: dict[str, float] = {}
    for key in {k for m in per_rank for k in m}:
        values = [m[key] for m in per_rank if key in m]
        if key in _SUMMED:
            out[key] = sum(values)
        elif key in _SLOWEST:
            out[key] = max(values)
        elif key in _SHARED:
            out[key] = per_rank[0][key]
        elif key.startswith("max_"):
            out[key] = max(values)
        elif tokens > 0:  # a per-policy-token mean: weighted by each rank's tokens
            out[key] = sum(m[key] * m["policy_tokens"] for m in worked if key in m) / tokens
        else:
            out[key] = values[0]
    seconds = out.get("seconds", 0.0)
    out["tokens_per_s"] = out.get("tokens", 0.0) / seconds if seconds > 0 else 0.0
    out["ranks"] = float(len(per_rank))
    return out


def _share_of(
    payload: dict[str, Any], rank: int
) -> tuple[list[Trajectory], list[Advantage], dict[str, Any], bool]:
    trajectories, advantages = payload["trajectories"], payload["advantages"]
    mine = payload["shares"][rank]
    kwargs = dict(payload["kwargs"])
    if not mine:  # fewer trajectories than ranks: run the shortest with no weight
        shortest = min(range(len(trajectories)), key=lambda i: len(trajectories[i].token_ids))
        kwargs.update(teacher=None, distill=None)
        return [trajectories[shortest]], [advantages[shortest]], kwargs, True
    teacher = kwargs.get("teacher")
    if teacher is not None:
        from dataclasses import replace

        kwargs["teacher"] = replace(teacher, targets=[teacher.targets[i] for i in mine])
    return [trajectories[i] for i in mine], [advantages[i] for i in mine], kwargs, False


def _run(policy: Policy, command: str, payload: Any, rank: int) -> Any:
    """One command, as every rank runs it (rank 0 through `LeaderPolicy`); `rank` is
    the data-parallel rank, whose share of a batch this rank trains."""
    if command == "train_step":
        trajectories, advantages, kwargs, idle = _share_of(payload, rank)
        return policy.train_step(trajectories, advantages, idle=idle, **kwargs)
    if command == "state_dict":
        return policy.state_dict()
    if command == "save_checkpoint":
        return policy.save_checkpoint(*payload)
    if command == "load_checkpoint":
        return policy.load_checkpoint(payload)
    raise InvalidInput(f"unknown rank command {command!r}", field="command")


def _exchange(message: Any = None) -> Any:
    """Rank 0's `message` to every rank (what the others receive)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gathered(value: Any) -> list[Any] | None:
    """Every rank's `value` at rank 0 (None elsewhere)."""
    import torch.distributed as dist

    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def follow(policy: Policy) -> int:
    """A rank other than 0: run rank 0's commands until it stops; the steps trained."""

    steps = 0
    while True:
        command, payload = _exchange()
        if command == "stop":
            return steps
        result = _run(policy, command, payload, policy.data_rank)
        if command == "train_step":
            _gathered((policy.data_rank, result))
            steps += 1


class LeaderPolicy:
    """Rank 0's policy: each collective call is sent to the other ranks first; any other
    attribute is the local policy's."""

    def __init__(self, policy: Policy) -> None:

        self.local = policy
        self.world = policy.data_ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def _all(self, command: str, payload: Any) -> Any:
        _exchange((command, payload))
        return _run(self.local, command, payload, self.local.data_rank)

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[Advantage],
        algorithm: Any = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        payload = {
            "trajectories": list(trajectories),
            "advantages": list(advantages),
            "shares": shares(trajectories, self.world),
            "kwargs": {"algorithm": algorithm, **kwargs},
        }
        mine = self._all("train_step", payload)
        per_rank = _gathered((self.local.data_rank, mine))
        assert per_rank is not None
        # Ranks of one data-parallel replica (tensor, pipeline) report its share alike.
        replicas = dict(per_rank)
        return combine([replicas[r] for r in sorted(replicas)])

    def state_dict(self) -> Any:
        return self._all("state_dict", None)

    def save_checkpoint(self, *args: Any) -> Any:
        return self._all("save_checkpoint", args)

    def load_checkpoint(self, directory: Any) -> Any:
        return self._all("load_checkpoint", directory)

    def stop(self) -> None:
        """Release the other ranks (`follow` returns)."""
        _exchange(("stop", None))
