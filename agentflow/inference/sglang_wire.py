"""SGLang 0.5.23's wire format: our request types to its JSON bodies, its answers to ours.

Pinned to 0.5.23 because routes and fields moved between releases. The server runs with
`--skip-tokenizer-init` semantics: we send `input_ids`, never text, and read `output_ids`.

This module is the one place that knows SGLang's request schema: the body models below
name every field this client sends, with SGLang's defaults and bounds, and the tables
list every other key 0.5.23 accepts. The client builds its bodies from the models, so it
cannot send a key SGLang does not know; the test suite's mock worker enforces the same
models and tables.

- `sampling_params` is strict on the server (an unknown key is a 400), so we send only keys
  0.5.23 knows: `temperature`, `top_p`, `max_new_tokens`, `stop_token_ids`,
  `sampling_seed`.
- Weight versions are strings on the wire (SGLang's default is `"default"`); the project
  counts them as integers, and `"default"` is version 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentflow.errors import EngineError
from agentflow.inference.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    VersionSpan,
)

SGLANG_VERSION = "0.5.23"
DEFAULT_WEIGHT_VERSION = "default"
# sglang-router 0.3.2 (`--policy manual`): requests with one key reach one worker.
ROUTING_KEY_HEADER = "x-smg-routing-key"


# ---- SGLang 0.5.23's request schema ----------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsBody(_Body):
    """The `sampling_params` keys this client sends."""

    max_new_tokens: int = Field(default=128, ge=0)  # 0: prefill only (scoring)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None


# SGLang's other `sampling_params` keys, which change what is generated: their defaults.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "top_k": -1,
    "min_p": 0.0,
    "stop": None,
    "stop_regex": None,
    "min_new_tokens": 0,
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
}
# ...and the ones that shape text only (no text is produced without a tokenizer).
SAMPLING_TEXT_ONLY = frozenset(
    {
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "ignore_eos",
        "stream_interval",
    }
)


class SessionParamsBody(_Body):
    """`session_params`: continue session `id` from request `rid` (its context cut to
    `offset`)."""

    id: str
    rid: str | None = None
    offset: int | None = Field(default=None, ge=0)
    replace: bool | None = None
    drop_previous_output: bool | None = None


class GenerateBody(_Body):
    """The `/generate` keys this client sends."""

    input_ids: list[int]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int | None = Field(default=None, ge=0)
    stream: bool = False  # server-sent events, one chunk as tokens come (StreamedAnswer)
    session_params: SessionParamsBody | None = None
    # One entry per image placeholder in `input_ids`, in order: a data URL, a URL or a
    # path the server can read, or raw base64 (this client sends data URLs).
    image_data: list[str] | None = None


# SGLang's other top-level `/generate` keys that change the answer: their defaults.
# sglang-router 0.3.2 re-serializes bodies and always sends `model`, `stream`,
# `log_metrics`, `return_text_in_logprobs`, `return_hidden_states`, `background`,
# `no_logs`, `return_bytes`, `return_entropy` with their defaults.
GENERATE_DEFAULTS: dict[str, Any] = {
    "text": None,
    "input_embeds": None,
    "video_data": None,
    "audio_data": None,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_entropy": False,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "background": False,
    "return_bytes": False,
}
# ...and the ones that do not change the ids and log-probs that come back.
GENERATE_INERT = frozenset(
    {
        "model",
        "log_metrics",
        "return_text_in_logprobs",
        "no_logs",
        "modalities",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "data_parallel_rank",
        "conversation_id",
        "priority",
        "extra_key",
        "custom_labels",
    }
)


class OpenSessionBody(_Body):
    capacity_of_str_len: int = Field(ge=1)
    session_id: str | None = None
    timeout: float | None = None


class CloseSessionBody(_Body):
    session_id: str


class UpdateWeightsFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class InitWeightsUpdateGroupBody(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    @model_validator(mode="after")
    def _trainer_is_rank_0(self) -> InitWeightsUpdateGroupBody:
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError("rank_offset must be in (0, world_size): the trainer is rank 0")
        return self


class UpdateWeightsFromDistributedBody(_Body):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributedBody:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must be of equal length")
        return self


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: list[str | bytes] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


def _dump(body: BaseModel) -> dict[str, Any]:
    """The fields the caller gave, as JSON-ready data: defaults are left to the server."""
    return body.model_dump(exclude_unset=True)


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


# ---- our requests to bodies ------------------------------------------------------------


def generate_body(req: GenerateRequest, *, stream: bool = False) -> dict[str, Any]:
    """The `/generate` body for one request; log-probs always, of the output tokens only."""
    s = req.sampling
    session = None
    if req.session is not None:
        session = SessionParamsBody(
            id=req.session.session_id,
            **_given(rid=req.session.parent_rid, offset=req.session.offset),
        )
    body = GenerateBody(
        input_ids=list(req.input_ids),
        sampling_params=SamplingParamsBody(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=list(s.stop_token_ids),
            **_given(sampling_seed=s.seed),
        ),
        return_logprob=True,
        logprob_start_len=-1,
        rid=req.rid,
        **_given(
            session_params=session,
            image_data=list(req.image_data) or None,
            top_logprobs_num=s.top_logprobs or None,
            stream=stream or None,
        ),
    )
    return _dump(body)


def open_session_body(capacity: int, session_id: str) -> dict[str, Any]:
    return _dump(OpenSessionBody(capacity_of_str_len=capacity, session_id=session_id))


def close_session_body(session_id: str) -> dict[str, Any]:
    return _dump(CloseSessionBody(session_id=session_id))


# ---- weight versions and answers -------------------------------------------------------


def version_to_wire(version: int) -> str:
    return str(version)


def version_from_wire(value: Any) -> int:
    if value is None or value == DEFAULT_WEIGHT_VERSION:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise EngineError(f"weight_version {value!r} is not an integer version")


def _finish_reason(raw: Any) -> FinishReason:
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind in ("stop", "length", "abort"):
        return kind
    raise EngineError(f"unexpected finish_reason {raw!r} (is the request still running?)")


def _spans(meta: dict[str, Any], n_out: int) -> list[VersionSpan]:
    raw = meta.get("weight_versions")
    if not raw:
        if n_out == 0:
            return []
        version = version_from_wire(meta.get("weight_version"))
        return [VersionSpan(version=version, start=0, end=n_out)]
    return spans_from_wire(raw)


def spans_from_wire(raw: Any) -> list[VersionSpan]:
    """An answer's `weight_versions` as both servers send them: a list of
    `{version, start, end}` (the version as its label string)."""
    if not isinstance(raw, list):
        raise EngineError(f"weight_versions must be a list, got {raw!r}")
    spans = []
    for item in raw:
        if not isinstance(item, dict) or not {"version", "start", "end"} <= item.keys():
            raise EngineError(f"weight_versions entry {item!r} lacks version/start/end")
        spans.append(
            VersionSpan(
                version=version_from_wire(item["version"]),
                start=int(item["start"]),
                end=int(item["end"]),
            )
        )
    return spans


def _logprobs(meta: dict[str, Any], output_ids: Sequence[int]) -> list[float]:
    raw = meta.get("output_token_logprobs")
    if not isinstance(raw, list) or len(raw) != len(output_ids):
        raise EngineError(
            f"output_token_logprobs has {len(raw) if isinstance(raw, list) else raw!r} "
            f"entries for {len(output_ids)} output tokens"
        )
    out = []
    for i, (entry, token) in enumerate(zip(raw, output_ids, strict=True)):
        # Each entry is [logprob, token_id, text-or-null]; the id must match what we got.
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
            raise EngineError(f"output_token_logprobs[{i}]={entry!r} does not match id {token}")
        out.append(float(entry[0]))
    return out


def _top_logprobs(meta: dict[str, Any], n_out: int) -> list[list[tuple[int, float]]] | None:
    """`output_top_logprobs`: per output token, entries `[logprob, token_id, text-or-null]`."""
    raw = meta.get("output_top_logprobs")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n_out:
        raise EngineError(f"output_top_logprobs has no entry per output token: {str(raw)[:200]}")
    out = []
    for i, step in enumerate(raw):
        if not isinstance(step, list) or not all(isinstance(e, list) and len(e) >= 2 for e in step):
            raise EngineError(f"output_top_logprobs[{i}]={step!r} is malformed")
        out.append([(int(e[1]), float(e[0])) for e in step])
    return out


def parse_generate(answer: Any, rid: str) -> GenerateResult:
    """Turn one `/generate` answer `{output_ids, meta_info}` into a `GenerateResult`."""
    if not isinstance(answer, dict) or "meta_info" not in answer or "output_ids" not in answer:
        raise EngineError(f"/generate answer lacks output_ids/meta_info: {str(answer)[:300]}")
    meta = answer["meta_info"]
    output_ids = [int(t) for t in answer["output_ids"]]
    if not isinstance(meta, dict):
        raise EngineError("meta_info is not an object")
    try:
        return GenerateResult(
            rid=str(meta.get("id", rid)),
            output_ids=output_ids,
            logprobs=_logprobs(meta, output_ids),
            finish_reason=_finish_reason(meta.get("finish_reason")),
            weight_versions=_spans(meta, len(output_ids)),
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            top_logprobs=_top_logprobs(meta, len(output_ids)),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineError(f"malformed /generate answer: {exc}") from exc


class StreamedAnswer:
    """The chunks of a streamed `/generate`, put back together.

    SGLang's chunks carry the output so far or only what is new, by server flags and
    release (`--stream-output`, `--incremental-streaming-output`); each chunk's
    `meta_info.completion_tokens` counts the tokens so far, which tells the two apart,
    and the log-prob lists follow their ids either way. `add` returns a chunk's new ids
    and log-probs; `answer` is the whole answer as a non-streamed `/generate` gives it.
    """

    _LISTS = ("output_token_logprobs", "output_top_logprobs")

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.lists: dict[str, list[Any]] = {key: [] for key in self._LISTS}
        self.meta: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        ids = [int(t) for t in chunk.get("output_ids") or []]
        meta = chunk.get("meta_info")
        if not isinstance(meta, dict):
            raise EngineError("a stream chunk has no meta_info")
        seen = len(self.output_ids)
        total = meta.get("completion_tokens")
        cumulative = total is not None and len(ids) == int(total) and len(ids) >= seen
        new = ids[seen:] if cumulative else ids
        if cumulative and ids[:seen] != self.output_ids:
            raise EngineError("a cumulative stream chunk does not extend the earlier ones")
        for key in self._LISTS:
            raw = meta.get(key)
            if raw is None:
                continue
            if not isinstance(raw, list):
                raise EngineError(f"{key} in a stream chunk is not a list")
            if len(raw) == seen + len(new):  # the whole list so far
                self.lists[key] = list(raw)
            elif len(raw) == len(new):  # the new tokens' entries
                self.lists[key] += raw
            else:
                raise EngineError(
                    f"{key} has {len(raw)} entries for {len(new)} new of {seen + len(new)} tokens"
                )
        self.output_ids += new
        self.meta = meta
        logprobs = _logprobs(
            {"output_token_logprobs": self.lists["output_token_logprobs"][seen:]}, new
        )
        return new, logprobs

    def answer(self) -> dict[str, Any]:
        meta = {**self.meta}
        for key, values in self.lists.items():
            if values or key in self.meta:
                meta[key] = values
        return {"output_ids": self.output_ids, "meta_info": meta}


def merge_spans(spans: Sequence[VersionSpan]) -> list[VersionSpan]:
    """Join adjacent spans of the same version (a resumed request often keeps its version)."""
    merged: list[VersionSpan] = []
    for span in sorted(spans, key=lambda s: s.start):
        if span.end == span.start:
            continue
        if merged and merged[-1].version == span.version and merged[-1].end == span.start:
            merged[-1] = VersionSpan(version=span.version, start=merged[-1].start, end=span.end)
        else:
            merged.append(span)
    return merged


def stitch(first: GenerateResult, more: GenerateResult) -> GenerateResult:
    """`first` was aborted and `more` continued it: one result, as if never interrupted.

    `prompt_tokens` and `cached_tokens` describe the first submission, the context the
    caller asked for; the continuation's context includes the partial output.
    """
    shift = len(first.output_ids)
    spans = list(first.weight_versions) + [
        VersionSpan(version=s.version, start=s.start + shift, end=s.end + shift)
        for s in more.weight_versions
    ]
    return GenerateResult(
        rid=first.rid,
        output_ids=first.output_ids + more.output_ids,
        logprobs=first.logprobs + more.logprobs,
        finish_reason=more.finish_reason,
        weight_versions=merge_spans(spans),
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        top_logprobs=(
            first.top_logprobs + more.top_logprobs
            if first.top_logprobs is not None and more.top_logprobs is not None
            else None
        ),
    )


def disk_update_body(model_path: str, version: int) -> dict[str, Any]:
    return _dump(
        UpdateWeightsFromDiskBody(model_path=model_path, weight_version=version_to_wire(version))
    )


def distributed_group_body(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
) -> dict[str, Any]:
    return _dump(
        InitWeightsUpdateGroupBody(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
    )


def distributed_update_body(
    *,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str,
    version: int,
    flush_cache: bool = True,
    load_format: str | None = None,
) -> dict[str, Any]:
    return _dump(
        UpdateWeightsFromDistributedBody(
            names=list(names),
            dtypes=[d.removeprefix("torch.") for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            weight_version=version_to_wire(version),
            **_given(load_format=load_format),
        )
    )


def tensor_update_body(
    serialized_named_tensors: Sequence[str],
    *,
    version: int,
    load_format: str | None = None,
    flush_cache: bool = True,
) -> dict[str, Any]:
    """Body for `/update_weights_from_tensor`: one serialized payload per TP rank.

    The payloads are CUDA IPC handles (same node only), serialized by the trainer.
    """
    return _dump(
        UpdateWeightsFromTensorBody(
            serialized_named_tensors=list(serialized_named_tensors),
            flush_cache=flush_cache,
            weight_version=version_to_wire(version),
            **_given(load_format=load_format),
        )
    )
