"""`sync = "nccl"`: the trainer broadcasts each weight version to the engines' GPUs.

    BroadcastPublisher(targets, settings).publish(state_dict, version) -> SyncReport

The first publish forms the group (`agentflow.inference.broadcast`): each target says how
many ranks it brings (`weight_group_ranks`), the group is the trainer (rank 0) and all of
them, and the targets join (`join_weight_group`, SGLang's `/init_weights_update_group`)
while this process joins as rank 0; the group forms when all have. Then every version:

1. the tensors go into buckets of at most `bucket_bytes` (state-dict order), less the
   names in `skip` (a tied output layer: `tied_names`; engines take it as the embedding)
   and less aliases of a tensor already sent;
2. each target is told the version and the buckets' names, dtypes and shapes
   (`WeightUpdate.broadcast`); behind a gateway the run's engines are paused under the
   run's partial-rollout policy first, and resumed and the version recorded after
   (`RunExecutor.update_weights`); SGLang's `/update_weights_from_distributed` answers
   when its bucket's broadcast has ended;
3. meanwhile rank 0 broadcasts the buckets in the same order.

A target that fails, or a broadcast that times out (`timeout_s`), fails the publish with
`WeightSyncError` and the version is not live; the group is then dropped (a half-finished
collective leaves it unusable) and the next publish forms a new one under a new name.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from agentflow.inference import broadcast
from agentflow.inference.base import (
    BroadcastWeights,
    TensorBucket,
    WeightGroup,
    WeightUpdate,
)
from agentflow.ports import free_port
from trainer.weights import SyncReport, TargetReport, WeightSyncError, target_name, unique_tensors

if TYPE_CHECKING:
    import torch

    from agentflow.run_config import RunConfig


class BroadcastSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["nccl", "gloo"] = Field(default="nccl", description="gloo: CPU tensors")
    master_address: str = Field(
        default="127.0.0.1", description="this trainer's address as the engines reach it"
    )
    master_port: int = Field(default=0, ge=0, le=65535, description="0: a free port")
    bucket_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    timeout_s: float = Field(default=600.0, gt=0, description="forming the group; a broadcast")
    device: str = Field(default="cuda", description="where rank 0's tensors are broadcast from")


@runtime_checkable
class BroadcastTarget(Protocol):
    """An engine (or a gateway run's engines) that receives broadcast weights."""

    async def weight_group_ranks(self) -> int: ...

    async def join_weight_group(self, group: WeightGroup) -> None: ...

    async def update_weights(self, update: WeightUpdate) -> int: ...


_groups = itertools.count(1)


def tied_names(model_config: Any) -> tuple[str, ...]:
    """What a model with tied embeddings need not send: its output layer is the embedding
    (a gathered FSDP state dict holds it as a tensor of its own, not an alias)."""
    return ("lm_head.weight",) if getattr(model_config, "tie_word_embeddings", False) else ()


def broadcast_settings(config: RunConfig) -> BroadcastSettings:
    """The run config's `[weights.broadcast]`, broadcasting from the trainer's device."""
    chosen = config.weights.broadcast
    return BroadcastSettings(
        backend=chosen.backend,
        master_address=chosen.master_address,
        master_port=chosen.master_port,
        bucket_bytes=int(chosen.bucket_mb * 1024 * 1024),
        timeout_s=chosen.timeout_s,
        device=config.trainer.device if chosen.backend == "nccl" else "cpu",
    )


class BroadcastPublisher:
    """Publishes weight versions to `targets` by broadcast; see the module docstring."""

    def __init__(
        self,
        targets: Sequence[BroadcastTarget],
        settings: BroadcastSettings | None = None,
        *,
        initial_version: int = 0,
        skip: Collection[str] = (),
    ) -> None:
        self.targets = list(targets)
        self.settings = settings or BroadcastSettings()
        self.skip = frozenset(skip)
        self._version = initial_version
        self._group: Any = None
        self._group_name = ""

    @property
    def published_version(self) -> int:
        return self._version

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> SyncReport:
        started = time.perf_counter()
        if self._group is None:
            await self._form_group()
        kept = {n: t for n, t in state_dict.items() if n not in self.skip}
        tensors = unique_tensors(kept, copy=False, drop_aliases=True)
        names = broadcast.plan_buckets(tensors, self.settings.bucket_bytes)
        update = WeightUpdate(
            version=version,
            broadcast=BroadcastWeights(
                group_name=self._group_name,
                buckets=[_describe([(n, tensors[n]) for n in bucket]) for bucket in names],
            ),
        )
        sending = asyncio.create_task(
            asyncio.to_thread(self._send, [[tensors[n] for n in bucket] for bucket in names])
        )
        reports = await asyncio.gather(
            *(self._switch(t, update) for t in self.targets), return_exceptions=True
        )
        failed = {
            target_name(t): f"{type(r).__name__}: {r}"
            for t, r in zip(self.targets, reports, strict=True)
            if isinstance(r, BaseException)
        }
        try:
            send_seconds = await sending
        except Exception as exc:  # a broadcast that timed out: the receivers went away
            failed.setdefault("broadcast", f"{type(exc).__name__}: {exc}")
            send_seconds = 0.0
        if failed:
            self._drop_group()
            switched = [r.name for r in reports if isinstance(r, TargetReport)]
            raise WeightSyncError(version, failed, switched)
        self._version = version
        return SyncReport(
            version=version,
            mode="nccl",
            seconds=time.perf_counter() - started,
            write_seconds=send_seconds,
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            targets=[r for r in reports if isinstance(r, TargetReport)],
        )

    async def _form_group(self) -> None:
        ranks = [await t.weight_group_ranks() for t in self.targets]
        world = 1 + sum(ranks)
        name = f"agentflow-weights-{os.getpid()}-{next(_groups)}"
        port = self.settings.master_port or free_port(self.settings.master_address)
        groups, offset = [], 1
        for count in ranks:
            groups.append(
                WeightGroup(
                    master_address=self.settings.master_address,
                    master_port=port,
                    group_name=name,
                    backend=self.settings.backend,
                    world_size=world,
                    rank_offset=offset,
                    timeout_s=self.settings.timeout_s,
                )
            )
            offset += count
        mine = groups[0].model_copy(update={"rank_offset": 1})
        joining = asyncio.create_task(asyncio.to_thread(broadcast.open_group, mine, 0))
        answers = await asyncio.gather(
            *(t.join_weight_group(g) for t, g in zip(self.targets, groups, strict=True)),
            return_exceptions=True,
        )
        failed = {
            target_name(t): f"{type(a).__name__}: {a}"
            for t, a in zip(self.targets, answers, strict=True)
            if isinstance(a, BaseException)
        }
        try:  # a target that refused leaves rank 0 waiting until its timeout
            group = await joining
        except Exception as exc:
            failed.setdefault("trainer (rank 0)", f"{type(exc).__name__}: {exc}")
            raise WeightSyncError(self._version + 1, failed, []) from None
        if failed:
            broadcast.close_group(group)
            raise WeightSyncError(self._version + 1, failed, [])
        self._group, self._group_name = group, name

    def _send(self, buckets: list[list[torch.Tensor]]) -> float:
        started = time.perf_counter()
        for bucket in buckets:
            broadcast.send_bucket(
                self._group, [t.to(self.settings.device, non_blocking=True) for t in bucket]
            )
        return time.perf_counter() - started

    @staticmethod
    async def _switch(target: BroadcastTarget, update: WeightUpdate) -> TargetReport:
        started = time.perf_counter()
        version = await target.update_weights(update)
        return TargetReport(target_name(target), time.perf_counter() - started, version)

    def _drop_group(self) -> None:
        if self._group is not None:
            # A group broken mid-collective may not close cleanly; it is dropped all the same.
            with contextlib.suppress(Exception):
                broadcast.close_group(self._group)
        self._group, self._group_name = None, ""

    def close(self) -> None:
        self._drop_group()


def _describe(named: list[tuple[str, torch.Tensor]]) -> TensorBucket:
    return TensorBucket(
        names=[n for n, _ in named],
        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
        shapes=[list(t.shape) for _, t in named],
    )
