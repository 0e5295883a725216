"""Weight sync by disk against weight sync by broadcast, for the same model in one run.

Disk (`sync = "disk"`): the trainer writes a version as safetensors (`WeightPublisher`)
and a receiver process loads the directory into memory, as an engine's
`/update_weights_from_disk` does. Broadcast (`sync = "nccl"`): the trainer forms a group
with the receiver process once, then broadcasts each version in buckets
(`BroadcastPublisher`), the receiver taking each bucket as SGLang's
`/update_weights_from_distributed` does. Both receivers run in the same child process,
so the two paths move the same bytes between the same two processes. Prints the median
seconds per version, GB/s and the ratio.

    python bench/weight_sync.py [--layers 8 --hidden 1024] [--repeat 5]
    python bench/weight_sync.py --backend nccl --device cuda   # two GPUs: cuda:0 -> cuda:1

On CPU the broadcast goes over gloo (TCP on loopback); with `--backend nccl` the trainer's
tensors are on cuda:0 and the receiver's on cuda:1 (NCCL will not join two ranks on one
GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentflow.inference import broadcast  # noqa: E402
from agentflow.inference.base import WeightGroup, WeightUpdate  # noqa: E402
from agentflow.modeling import ModelInit, build_model  # noqa: E402
from trainer.broadcast_sync import BroadcastPublisher, BroadcastSettings  # noqa: E402
from trainer.weights import WeightPublisher  # noqa: E402


def receiver(inbox: Any, outbox: Any, device: str) -> None:
    """The engine's side: load a directory, or join the group and receive buckets."""
    from safetensors.torch import load_file

    group = None
    while True:
        kind, payload = inbox.get()
        started = time.perf_counter()
        if kind == "stop":
            return
        if kind == "disk":
            loaded = {}
            for file in sorted(Path(payload).glob("*.safetensors")):
                loaded.update(load_file(str(file), device=device))
            outbox.put(("loaded", time.perf_counter() - started))
        elif kind == "join":
            group = broadcast.open_group(payload, payload.rank_offset)
            outbox.put(("joined", 0.0))
        elif kind == "broadcast":
            for bucket in payload.buckets:
                broadcast.receive_bucket(group, bucket, device=device)
            outbox.put(("received", time.perf_counter() - started))


class ChildEngine:
    """A `WeightTarget` and `BroadcastTarget` whose weights land in the child process."""

    name = "child"

    def __init__(self, inbox: Any, outbox: Any) -> None:
        self.inbox, self.outbox = inbox, outbox

    async def _ask(self, kind: str, payload: Any) -> float:
        self.inbox.put((kind, payload))
        _, seconds = await asyncio.to_thread(self.outbox.get)
        return float(seconds)

    async def update_weights(self, update: WeightUpdate) -> int:
        if update.path is not None:
            await self._ask("disk", update.path)
        else:
            await self._ask("broadcast", update.broadcast)
        assert update.version is not None
        return update.version

    async def weight_group_ranks(self) -> int:
        return 1

    async def join_weight_group(self, group: WeightGroup) -> None:
        await self._ask("join", group)


async def measure(args: argparse.Namespace) -> None:
    import torch

    init = ModelInit(layers=args.layers, hidden=args.hidden, heads=args.heads, max_context=2048)
    model = build_model(init, seed=0).to(args.device)
    state = model.state_dict()
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    child_device = "cuda:1" if args.backend == "nccl" else "cpu"
    child = context.Process(target=receiver, args=(inbox, outbox, child_device), daemon=True)
    child.start()
    engine = ChildEngine(inbox, outbox)
    disk, sent = [], []
    nbytes = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            to_disk = WeightPublisher("disk", [engine], Path(tmp), config=model.config, keep=1)
            over_group = BroadcastPublisher(
                [engine],
                BroadcastSettings(
                    backend=args.backend,
                    device=args.device,
                    bucket_bytes=int(args.bucket_mb * 1024 * 1024),
                ),
            )
            await over_group.publish(state, 1)  # forms the group: not a version's cost
            for k in range(args.repeat):
                version = 2 + 2 * k
                report = await to_disk.publish(state, version)
                disk.append(report.seconds)
                nbytes = report.bytes
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                report = await over_group.publish(state, version + 1)
                sent.append(report.seconds)
            over_group.close()
    finally:
        inbox.put(("stop", None))
        child.join(timeout=30)
    gb = nbytes / 1e9
    d, b = statistics.median(disk), statistics.median(sent)
    print(f"model: {sum(t.numel() for t in state.values()) / 1e6:.1f} M parameters, {gb:.3f} GB")
    print(f"disk sync:      {d:.3f} s per version, {gb / d:.2f} GB/s (write + load)")
    print(f"broadcast sync: {b:.3f} s per version, {gb / b:.2f} GB/s ({args.backend})")
    print(f"broadcast / disk time: {b / d:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.backend == "nccl" and not args.device.startswith("cuda"):
        parser.error("--backend nccl broadcasts CUDA tensors: pass --device cuda")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
