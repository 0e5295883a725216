"""Weight sync: publish the trainer's weights to every inference engine as one version.

    WeightPublisher(mode, targets).publish(state_dict, version) -> SyncReport

Two ways to hand weights over (docs/architecture.md, "Trainer"; `nccl` is a separate path):

- `inprocess`: each target gets `WeightUpdate(state_dict=..., version=...)` holding a
  detached *copy* of the tensors, so the optimizer's next step never changes what an
  engine serves. For a `LocalEngine` in the trainer's own process.
- `disk`: the weights are written as an HF-format checkpoint (safetensors shards, with
  `model.safetensors.index.json` when there is more than one, `config.json`, the
  project's `agentflow_model_init.json` when the model has one, and a `manifest.json`
  with every file's size and sha256) into `directory/v{version:06d}/`; each target gets
  `WeightUpdate(path=..., version=...)`. SGLang loads it with `/update_weights_from_disk`,
  a `LocalEngine` or `agentflow.modeling.load_model` reads it as any HF checkpoint, and
  `GatewayWeightTarget` forwards it to a run's engines through the gateway's REST API.
  The directory is written under a temporary name and renamed into place, so a reader
  never sees half a version.

Targets switch concurrently. A version is *live* only when every target has switched:
if one fails, `publish` raises `WeightSyncError` naming it and the targets that did
switch, and `published_version` stays where it was (the caller may publish again).
After a successful disk publish, version directories older than the newest `keep` are
removed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from agentflow.errors import EngineError, InvalidInput
from agentflow.inference.base import WeightGroup, WeightUpdate
from agentflow.modeling import MODEL_INIT_FILE

if TYPE_CHECKING:
    import torch

    from agentflow.client import AsyncClient

SyncMode = Literal["inprocess", "disk", "nccl"]

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 512 * 1024 * 1024
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


@runtime_checkable
class WeightTarget(Protocol):
    """Anything that takes a weight update and answers the version it now serves.

    Every `Engine` is one. A `name` attribute, when present, is how reports and errors
    call the target (see `target_name`).
    """

    async def update_weights(self, update: WeightUpdate) -> int: ...


class Publisher(Protocol):
    """What the train loop publishes each version through: `WeightPublisher` (inprocess,
    disk) or `trainer.broadcast_sync.BroadcastPublisher` (nccl)."""

    @property
    def published_version(self) -> int: ...

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> SyncReport: ...


def target_name(target: object) -> str:
    """How reports name `target`: its `name`, else its class and URL or model name."""
    name = getattr(target, "name", None)
    if isinstance(name, str) and name:
        return name
    where = getattr(getattr(target, "settings", None), "url", None)
    where = where or getattr(target, "model_name", None)
    kind = type(target).__name__
    return f"{kind}({where})" if where else kind


class WeightSyncError(EngineError):
    """Some target did not switch to `version`, so that version is not live."""

    def __init__(self, version: int, failed: Mapping[str, str], switched: Sequence[str]) -> None:
        causes = "; ".join(f"{name}: {why}" for name, why in failed.items())
        super().__init__(
            f"weight version {version} is not live: {len(failed)} target(s) failed "
            f"({causes}); switched: {list(switched) or 'none'}"
        )
        self.version = version
        self.failed = dict(failed)
        self.switched = list(switched)


@dataclass(frozen=True)
class TargetReport:
    name: str
    seconds: float
    version: int


@dataclass(frozen=True)
class SyncReport:
    """What one publish did and how long each part took."""

    version: int
    mode: SyncMode
    seconds: float  # the whole publish
    write_seconds: float  # copying the tensors (inprocess) or writing the directory (disk)
    bytes: int  # of weights handed over, tied tensors counted once
    targets: list[TargetReport]  # per target: how long it took to switch
    path: str | None = None  # the version directory (disk)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeightPublisher:
    """Publishes weight versions to `targets`; see the module docstring.

    `config` is the model's HF config (`model.config`): `disk` writes it as
    `config.json` (and its `agentflow_init`, when set, as `agentflow_model_init.json`)
    so that the directory is a complete checkpoint. `shard_bytes` caps each safetensors
    file (a tensor larger than the cap gets a file of its own).
    """

    def __init__(
        self,
        mode: SyncMode,
        targets: Sequence[WeightTarget],
        directory: str | Path | None = None,
        *,
        config: Any = None,
        keep: int = 2,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        initial_version: int = 0,
        untied_head: bool = False,
    ) -> None:
        if mode not in ("inprocess", "disk"):
            raise InvalidInput(f"unknown weight sync mode {mode!r}", field="mode")
        if mode == "disk" and (directory is None or config is None):
            raise InvalidInput("disk sync needs a directory and the model's config", field="mode")
        if keep < 1:
            raise InvalidInput(f"keep must be >= 1, got {keep}", field="keep")
        if shard_bytes < 1:
            raise InvalidInput(f"shard_bytes must be >= 1, got {shard_bytes}", field="shard_bytes")
        self.mode: SyncMode = mode
        # A tied output embedding also written as `lm_head.weight`, for servers that
        # serve it untied (vLLM: docs/inference.md, "A tied output embedding").
        self.untied_head = untied_head
        self.targets = list(targets)
        self.directory = Path(directory) if directory is not None else None
        self.config = config
        self.keep = keep
        self.shard_bytes = shard_bytes
        self._names = _unique([target_name(t) for t in self.targets])
        self._version = initial_version

    @property
    def published_version(self) -> int:
        """The newest version every target serves (`initial_version` before any publish)."""
        return self._version

    def version_dir(self, version: int) -> Path:
        assert self.directory is not None
        return self.directory / f"v{version:06d}"

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> SyncReport:
        """Make `version` live on every target, or raise `WeightSyncError`.

        `inprocess` copies the tensors before it first yields; `disk` reads them while it
        writes, so the next optimizer step must wait for this call (as the train loop does).
        """
        if version <= self._version:
            raise InvalidInput(
                f"weight version {version} is not newer than {self._version}", field="version"
            )
        started = time.perf_counter()
        if self.mode == "inprocess":
            # Copied before the first await: the caller's next optimizer step cannot race it.
            tensors = unique_tensors(state_dict, copy=True, drop_aliases=False)
            update = WeightUpdate(state_dict=tensors, version=version)
            path = None
        else:
            tensors = unique_tensors(state_dict, copy=False, drop_aliases=True)
            if self.untied_head:
                tensors = with_untied_head(tensors)
            final = self.version_dir(version)
            await asyncio.to_thread(self._write_version, tensors, version, final)
            update = WeightUpdate(path=str(final), version=version)
            path = str(final)
        written = time.perf_counter()
        nbytes = _tensor_bytes(tensors.values(), unique=True)
        reports = await self._switch_all(update)
        self._version = version
        if self.mode == "disk":
            await asyncio.to_thread(self._prune)
        return SyncReport(
            version=version,
            mode=self.mode,
            seconds=time.perf_counter() - started,
            write_seconds=written - started,
            bytes=nbytes,
            targets=reports,
            path=path,
        )

    async def _switch_all(self, update: WeightUpdate) -> list[TargetReport]:
        assert update.version is not None
        results = await asyncio.gather(
            *(
                self._switch(name, t, update)
                for name, t in zip(self._names, self.targets, strict=True)
            ),
            return_exceptions=True,
        )
        failed: dict[str, str] = {}
        reports: list[TargetReport] = []
        for name, result in zip(self._names, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation and interrupts are not a target's failure
                failed[name] = f"{type(result).__name__}: {result}"
            else:
                reports.append(result)
        if failed:
            raise WeightSyncError(update.version, failed, [r.name for r in reports])
        return reports

    @staticmethod
    async def _switch(name: str, target: WeightTarget, update: WeightUpdate) -> TargetReport:
        started = time.perf_counter()
        got = await target.update_weights(update)
        if got != update.version:
            raise EngineError(f"answered version {got}, expected {update.version}")
        return TargetReport(name=name, seconds=time.perf_counter() - started, version=got)

    # -- disk ---------------------------------------------------------------------------

    def _write_version(self, tensors: dict[str, torch.Tensor], version: int, final: Path) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_checkpoint(tensors, tmp, config=self.config, shard_bytes=self.shard_bytes)
            write_manifest(tmp, version)
            if final.exists():  # left by a publish whose targets failed: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _prune(self) -> None:
        """Drop versions older than the newest `keep` live ones, and abandoned temp dirs."""
        assert self.directory is not None
        versions: list[tuple[int, Path]] = []
        for entry in self.directory.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and entry.is_dir() and int(match.group(1)) <= self._version:
                versions.append((int(match.group(1)), entry))
            elif entry.name.startswith(".v") and ".tmp-" in entry.name:
                shutil.rmtree(entry, ignore_errors=True)
        versions.sort()
        for _, old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def with_untied_head(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with the output head written out when it is the input embedding's alias
    (dropped as one): a copy, since a checkpoint file holds no shared storage."""
    if HEAD in tensors or EMBEDDING not in tensors:
        return tensors
    return {**tensors, HEAD: tensors[EMBEDDING].detach().clone()}


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    directory: Path,
    *,
    config: Any,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """An HF-format checkpoint of `tensors` (no aliases) in `directory`; the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
    written = []
    for file_name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        written.append(directory / file_name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": _tensor_bytes(tensors.values(), unique=False)},
            "weight_map": {n: f for f, shard in zip(names, shards, strict=True) for n in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        written.append(directory / INDEX_FILE)
    config.save_pretrained(directory)
    written.append(directory / "config.json")
    init = getattr(config, "agentflow_init", None)
    if init is not None:
        (directory / MODEL_INIT_FILE).write_text(json.dumps(init, indent=2))
        written.append(directory / MODEL_INIT_FILE)
    return written


def write_manifest(directory: Path, version: int) -> dict[str, Any]:
    """`manifest.json`: the version and every file's size and sha256, for readers to check."""
    files: list[dict[str, Any]] = []
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        files.append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path)})
    manifest = {
        "version": version,
        "created": datetime.now(UTC).isoformat(),
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files),
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return manifest


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class GatewayWeightTarget:
    """A run's engines behind a gateway: `POST /v1/runs/{run_id}/weights`.

    For a trainer in its own process (`agentflow trainer --gateway URL`). With `disk`
    sync it names a directory, which must be readable at the same path where the gateway
    and engines run; with `nccl` sync it names the buckets being broadcast and is a
    `BroadcastTarget` (trainer/broadcast_sync.py): the run's engines join the trainer's
    group through the gateway. Either way the gateway pauses the run's engines, switches
    them and records the version.

    Without `client`, each call is sent once and may take `timeout_s` (the default of
    `trainer.gateway.publish_timeout_s`); the split trainer passes a client that retries
    each call with that deadline per attempt (trainer/remote.py).
    """

    def __init__(
        self,
        base_url: str,
        run_id: uuid.UUID | str,
        api_key: str | None = None,
        *,
        timeout_s: float = 240.0,
        client: AsyncClient | None = None,
    ) -> None:
        from agentflow.client import AsyncClient

        self.run_id = str(run_id)
        self.name = f"gateway {base_url.rstrip('/')} run {self.run_id}"
        self._own_client = client is None
        self._client = client or AsyncClient(base_url, api_key=api_key, timeout_s=timeout_s)

    async def update_weights(self, update: WeightUpdate) -> int:
        if update.version is None or update.state_dict is not None:
            raise InvalidInput(
                "a gateway takes a versioned weights directory (disk sync) or broadcast "
                "(nccl sync)",
                field="mode",
            )
        return await self._client.update_weights(
            self.run_id, update.version, update.path, broadcast=update.broadcast
        )

    async def weight_group_ranks(self) -> int:
        return await self._client.weight_group_ranks(self.run_id)

    async def join_weight_group(self, group: WeightGroup) -> None:
        await self._client.join_weight_group(self.run_id, group)

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


def _unique(names: list[str]) -> list[str]:
    """Reports key targets by name: number repeated names (two `LocalEngine`s, say)."""
    if len(set(names)) == len(names):
        return names
    return [f"{name}#{i}" for i, name in enumerate(names)]


def unique_tensors(
    state_dict: Mapping[str, torch.Tensor], *, copy: bool, drop_aliases: bool
) -> dict[str, torch.Tensor]:
    """Detached tensors by name; names that alias one tensor (tied embeddings) are either
    dropped after the first (safetensors refuses shared storage; HF drops them too) or
    kept pointing at the same copy (a copy per name would double the memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if t.numel() == 0:  # empty tensors share a null data pointer without aliasing
            out[name] = t.clone() if copy else t
            continue
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key in seen:
            if not drop_aliases:
                out[name] = seen[key]
            continue
        seen[key] = out[name] = t.clone() if copy else t
    return out


def _tensor_bytes(tensors: Any, *, unique: bool) -> int:
    counted: set[int] = set()
    total = 0
    for t in tensors:
        if unique and id(t) in counted:
            continue
        counted.add(id(t))
        total += t.numel() * t.element_size()
    return total
