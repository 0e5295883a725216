"""The `Engine` protocol: how the rollout side talks to any inference backend.

It mirrors SGLang's semantics (sessions as trees of requests keyed by rid, pause modes,
weight versions as spans) so that `LocalEngine` and `SGLangEngine` behave alike and the
rest of the system never asks which one it holds. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentflow import ids
from agentflow.errors import EngineRequestError
from agentflow.integers import Int32, Int64
from agentflow.types import FLOAT32_OVERFLOW

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    """How to sample. Log-probs are always of `log_softmax(logits / temperature)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="0 is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=128, ge=1)
    stop_token_ids: tuple[int, ...] = Field(default=(), description="end generation on these")
    seed: int | None = Field(default=None, description="per-request sampling seed")
    top_logprobs: int = Field(
        default=0, ge=0, le=20, description="also report this many most likely tokens per step"
    )


class SessionRef(BaseModel):
    """Continue a session: the context is `parent_rid`'s prompt + output (cut to `offset`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str
    parent_rid: str | None = Field(default=None, description="None: start with no history")
    offset: int | None = Field(default=None, ge=0, description="keep only context[:offset]")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input_ids: tuple[int, ...] = Field(description="new tokens (after the session's context)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    rid: str = Field(default_factory=ids.new_hex)
    session: SessionRef | None = None
    routing_key: str | None = Field(default=None, description="sticky routing behind a router")
    image_data: tuple[str, ...] = Field(
        default=(),
        description="images as data URLs, one per image placeholder in the context, in "
        "order; only for engines whose `accepts_images()` is true",
    )


# An engine's answer is checked here, where it enters: what a turn record would refuse
# (`agentflow.types.TurnRecord`) is refused already, so the episode loop records it as is.
TokenId = Annotated[Int32, Field(ge=0)]
# Finite, and finite in float32 too (the stored width).
LogProb = Annotated[float, Field(allow_inf_nan=False, gt=-FLOAT32_OVERFLOW, lt=FLOAT32_OVERFLOW)]


class VersionSpan(BaseModel):
    """Output tokens `[start, end)` were produced by weight `version`."""

    model_config = ConfigDict(frozen=True)

    version: Int32 = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class GenerateResult(BaseModel):
    rid: str
    output_ids: list[TokenId]
    logprobs: list[LogProb]
    finish_reason: FinishReason
    weight_versions: list[VersionSpan]
    prompt_tokens: int = Field(description="full context length the engine saw")
    cached_tokens: int = Field(default=0, description="context tokens served from KV cache")
    queue_s: float = Field(
        default=0.0,
        ge=0.0,
        description="seconds the request waited for a decode slot before it first ran, "
        "where the engine reports it (0.0 otherwise)",
    )
    top_logprobs: list[list[tuple[int, float]]] | None = Field(
        default=None,
        description="per output token, the most likely (token, log-prob) pairs, when "
        "`sampling.top_logprobs` asked for them",
    )

    @model_validator(mode="after")
    def _consistent(self) -> GenerateResult:
        if len(self.logprobs) != len(self.output_ids):
            raise ValueError("logprobs and output_ids differ in length")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ValueError("top_logprobs and output_ids differ in length")
        covered = sum(s.end - s.start for s in self.weight_versions)
        if covered != len(self.output_ids):
            raise ValueError("weight_versions spans do not cover output_ids exactly")
        return self

    def token_versions(self) -> list[int]:
        """The weight version of each output token, in order."""
        out: list[int] = []
        for span in sorted(self.weight_versions, key=lambda s: s.start):
            out.extend([span.version] * (span.end - span.start))
        return out

    def cut(self, length: int, finish_reason: FinishReason) -> GenerateResult:
        """The first `length` output tokens only, ended for `finish_reason` (a stop
        string found in the text): what came after was sampled but is not kept."""
        spans = [
            VersionSpan(version=s.version, start=s.start, end=min(s.end, length))
            for s in self.weight_versions
            if s.start < length
        ]
        tops = self.top_logprobs[:length] if self.top_logprobs is not None else None
        return self.model_copy(
            update={
                "output_ids": self.output_ids[:length],
                "logprobs": self.logprobs[:length],
                "weight_versions": spans,
                "finish_reason": finish_reason,
                "top_logprobs": tops,
            }
        )


# Called on the event loop with each run of new output tokens and their log-probs, as
# the engine produces them. It must not block; to end the generation early, abort its rid.
TokenObserver = Callable[[Sequence[int], Sequence[float]], None]


class PauseMode(StrEnum):
    ABORT = "abort"  # running requests end now with partial output, finish_reason "abort"
    RETRACT = "retract"  # requests go back to the queue; KV is recomputed after resume
    IN_PLACE = "in_place"  # requests keep their KV; a weight update must not flush it


class WeightGroup(BaseModel):
    """A process group in which a trainer (rank 0) broadcasts weights to engine ranks
    (`agentflow.inference.broadcast`); an engine's ranks join from `rank_offset` on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_address: str = Field(min_length=1, description="where rank 0 serves the store")
    master_port: Int32 = Field(ge=1, le=65535)
    group_name: str = Field(min_length=1, max_length=200)
    backend: Literal["nccl", "gloo"] = Field(default="nccl", description="gloo: CPU tensors")
    # torch.distributed takes ranks and sizes as C ints.
    world_size: Int32 = Field(ge=2, description="the trainer and every engine rank")
    rank_offset: Int32 = Field(default=1, ge=1, description="this engine's first rank")
    timeout_s: float = Field(default=600.0, gt=0, description="joining and each broadcast")

    @model_validator(mode="after")
    def _offset_inside(self) -> WeightGroup:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside the group")
        return self


class TensorBucket(BaseModel):
    """Tensors broadcast one after another, in this order (SGLang's
    `/update_weights_from_distributed` body)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(description="torch dtype names: `bfloat16`, `float32`")
    shapes: list[list[Int64]]

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> TensorBucket:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must be of equal length")
        return self


class BroadcastWeights(BaseModel):
    """Weights that arrive over a `WeightGroup`, bucket after bucket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_name: str = Field(min_length=1, max_length=200)
    buckets: list[TensorBucket] = Field(min_length=1)


BROADCAST_URI_PREFIX = "broadcast://"  # a recorded version whose weights were broadcast


class WeightUpdate(BaseModel):
    """New weights: tensors handed over in process, a safetensors directory on disk, or
    tensors a trainer broadcasts over a `WeightGroup` the engine has joined."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    # Recorded in 32-bit columns and token arrays (agentflow.integers): a trainer in the
    # gateway's process is held to the range the API holds one to.
    version: Int32 | None = Field(default=None, description="None: current version + 1")
    state_dict: Mapping[str, Any] | None = None
    path: str | None = Field(default=None, description="HF-format safetensors directory")
    broadcast: BroadcastWeights | None = None

    @model_validator(mode="after")
    def _one_source(self) -> WeightUpdate:
        given = [x for x in (self.state_dict, self.path, self.broadcast) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of state_dict, path or broadcast")
        return self

    @property
    def uri(self) -> str | None:
        """Where the version's weights came from, as a run records it (None: in process)."""
        if self.broadcast is not None:
            return BROADCAST_URI_PREFIX + self.broadcast.group_name
        return self.path


def next_weight_version(current: int, update: WeightUpdate) -> int:
    """The version `update` switches to: the one it names, or `current + 1`. Versions
    only move forward, so every token's version says which weights made it."""
    version = current + 1 if update.version is None else update.version
    if version <= current:
        raise EngineRequestError(f"weight version {version} is not newer than {current}")
    return version


class EngineInfo(BaseModel):
    model: str
    vocab_size: int
    max_context: int
    weight_version: int
    running: int = 0
    waiting: int = 0
    paused: bool = False
    sessions: int = 0
    kv_tokens: int = Field(default=0, description="tokens held in session KV caches")
    accepts_images: bool = Field(default=False, description="takes `image_data` (a vision model)")
    extra: dict[str, Any] = Field(default_factory=dict)


@runtime_checkable
class BroadcastReceiver(Protocol):
    """An engine that takes weights broadcast by a trainer (`WeightUpdate.broadcast`)."""

    async def weight_group_ranks(self) -> int:
        """How many ranks of this engine join a weight group (its GPUs)."""
        ...

    async def join_weight_group(self, group: WeightGroup) -> None:
        """Have every rank join `group` from `group.rank_offset` on; returns once the whole
        group has formed, so the trainer joins at the same time."""
        ...


@runtime_checkable
class Engine(Protocol):
    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    async def open_session(self, session_id: str | None = None) -> str: ...

    async def close_session(self, session_id: str) -> None: ...

    async def abort(self, rid: str) -> None: ...

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, update: WeightUpdate) -> int: ...

    async def info(self) -> EngineInfo: ...

    async def accepts_images(self) -> bool:
        """Whether `generate` takes `image_data`: callers ask before recording anything of
        a request with images, rather than asking which engine class they hold."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that shows output tokens while it generates them."""

    async def generate_observed(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult: ...


async def generate_observed(
    engine: Engine, req: GenerateRequest, observer: TokenObserver | None
) -> GenerateResult:
    """`engine.generate(req)`, showing `observer` the tokens as they come: as the engine
    produces them where it streams (`StreamingEngine`), else all at once at the end."""
    if observer is not None and isinstance(engine, StreamingEngine):
        return await engine.generate_observed(req, observer)
    result = await engine.generate(req)
    if observer is not None and result.output_ids:
        observer(result.output_ids, result.logprobs)
    return result
