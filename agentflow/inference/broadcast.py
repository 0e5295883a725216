"""Weights broadcast from a trainer to inference workers over a process group of their own.

SGLang's `/init_weights_update_group` has each worker rank join a group in which the
trainer is rank 0; `/update_weights_from_distributed` then has them receive one bucket of
tensors, in the order its `names` list them, from rank 0's `broadcast`. Both sides build
that group the same way, apart from any group the processes already have (the trainer's
own ranks, a worker's tensor-parallel ranks): a TCP store at `master_address:master_port`
served by rank 0, namespaced by the group's name, and a process group on it with the
group's backend (`nccl` between GPUs; `gloo` moves CPU tensors, which is how this is
tested without one). SGLang's side reaches the same store through torch's `rendezvous`.

torch has no public call for a process group outside the default world; this uses the
same internal one (`_new_process_group_helper`) that SGLang's receiving side uses, so the
two agree on the store layout. It is pinned by torch's version in the project's extras.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from agentflow.errors import InvalidInput

if TYPE_CHECKING:
    import torch

    from agentflow.inference.base import TensorBucket, WeightGroup


def open_group(group: WeightGroup, rank: int) -> Any:
    """Join `group` as `rank` (0: the trainer, which serves the store); blocks until all
    `group.world_size` ranks have joined, or `group.timeout_s` passes."""
    from torch.distributed import TCPStore
    from torch.distributed import distributed_c10d as c10d

    if not 0 <= rank < group.world_size:
        raise InvalidInput(f"rank {rank} is outside a group of {group.world_size}", field="rank")
    timeout = timedelta(seconds=group.timeout_s)
    # The store itself, not `rendezvous("tcp://...")`: under torchrun (several trainer
    # ranks) rendezvous connects to torchrun's agent store instead of serving one.
    served = TCPStore(
        group.master_address,
        group.master_port,
        group.world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    world_size = group.world_size
    store = c10d.PrefixStore(group.group_name, served)
    # torch renamed the options argument; either way none are given.
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    process_group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(group.backend),
        store,
        group_name=cast(Any, group.group_name),  # torch types it as its own str alias
        timeout=timeout,
        **{options: None},
    )
    # Global rank = group rank, so `broadcast(src=0, group=...)` means the trainer.
    c10d._world.pg_group_ranks[process_group] = {i: i for i in range(world_size)}
    return process_group


def close_group(process_group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(process_group)


def send_bucket(process_group: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0: broadcast each tensor, in the bucket's order."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=process_group)


def receive_bucket(
    process_group: Any, bucket: TensorBucket, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """A worker rank: the bucket's tensors, received in its order."""
    import torch
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype_of(dtype), device=device)
        dist.broadcast(tensor, src=0, group=process_group)
        out[name] = tensor
    return out


def dtype_of(name: str) -> torch.dtype:
    """`"bfloat16"` (SGLang's spelling) → torch.bfloat16."""
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"{name!r} is not a torch dtype", field="dtypes")
    return dtype


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names in buckets of at most `bucket_bytes` each (a larger tensor goes alone), in
    the state dict's order."""
    if bucket_bytes < 1:
        raise InvalidInput(f"bucket_bytes must be >= 1, got {bucket_bytes}", field="bucket_bytes")
    buckets: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets
