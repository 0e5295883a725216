"""SGLang 0.5.23's request schema, as the mock worker enforces it.

Every key SGLang knows is listed; the ones this worker cannot honour must keep their
default (or be absent), so a request never silently gets a different behaviour than
it would from SGLang. Keys SGLang does not know are refused, as SGLang refuses unknown
`sampling_params` keys.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# sampling_params keys this worker implements; the rest of SGLang's keys must be default.
_SAMPLING_DEFAULTS: dict[str, Any] = {
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
# Harmless without a tokenizer (they shape text, and no text is produced).
_SAMPLING_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "ignore_eos",
    "stream_interval",
}

# Top-level /generate keys: the router (0.3.2) re-serializes bodies and always sends
# `model`, `stream`, `log_metrics`, `return_text_in_logprobs`, `return_hidden_states`,
# `background`, `no_logs`, `return_bytes`, `return_entropy` with their defaults.
_TOP_DEFAULTS: dict[str, Any] = {
    "text": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "stream": False,
    "return_hidden_states": False,
    "return_entropy": False,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "background": False,
    "return_bytes": False,
}
_TOP_IGNORED = {
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
_TOP_IMPLEMENTED = {
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "session_params",
}


class Refusal(ValueError):
    pass


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None


class SessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    rid: str | None = None
    offset: int | None = Field(default=None, ge=0)
    replace: bool | None = None
    drop_previous_output: bool | None = None


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    session_params: SessionBody | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> GenerateBody:
        unknown = raw.keys() - _TOP_DEFAULTS.keys() - _TOP_IGNORED - _TOP_IMPLEMENTED
        if unknown:
            raise Refusal(f"unknown /generate keys: {sorted(unknown)}")
        _require_defaults(raw, _TOP_DEFAULTS, "")
        if "input_ids" not in raw:
            raise Refusal("input_ids is required (this server runs without a tokenizer)")
        if raw["input_ids"] and isinstance(raw["input_ids"][0], list):
            raise Refusal("batched input_ids are not supported by this worker")
        if raw.get("logprob_start_len", -1) != -1:
            raise Refusal("only logprob_start_len=-1 (output log-probs) is supported")
        sampling = raw.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise Refusal("sampling_params must be an object")
        unknown = sampling.keys() - SamplingBody.model_fields.keys() - _SAMPLING_IGNORED
        unknown -= _SAMPLING_DEFAULTS.keys()
        if unknown:
            # SGLang's own wording for the same mistake.
            raise Refusal(f"Unknown sampling parameter(s): {sorted(unknown)}")
        _require_defaults(sampling, _SAMPLING_DEFAULTS, "sampling_params.")
        session = raw.get("session_params")
        if isinstance(session, dict) and (
            session.get("replace") or session.get("drop_previous_output")
        ):
            raise Refusal("session_params.replace/drop_previous_output are not supported")
        kept = {k: v for k, v in sampling.items() if k in SamplingBody.model_fields}
        return cls.model_validate({**raw, "sampling_params": kept})


def _require_defaults(body: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    for key, default in defaults.items():
        if key in body and body[key] != default and body[key] is not None:
            raise Refusal(f"{prefix}{key}={body[key]!r} is not supported by this worker")


class OpenSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity_of_str_len: int = Field(ge=1)
    session_id: str | None = None
    timeout: float | None = None


class UpdateFromDiskBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

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

    def version(self) -> int | None:
        if self.weight_version is None:
            return None
        if not self.weight_version.isdigit():
            raise Refusal(f"weight_version {self.weight_version!r}: this worker counts integers")
        return int(self.weight_version)


class _GroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class _DistributedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class _TensorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: list[str | bytes] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


def check_distributed_group(raw: dict[str, Any]) -> None:
    body = _GroupBody.model_validate(raw)
    if body.rank_offset >= body.world_size:
        raise Refusal("rank_offset must be below world_size")


def check_distributed_update(raw: dict[str, Any]) -> None:
    body = _DistributedBody.model_validate(raw)
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise Refusal("names, dtypes and shapes differ in length")


def check_tensor_update(raw: dict[str, Any]) -> None:
    _TensorBody.model_validate(raw)


__all__ = [
    "GenerateBody",
    "OpenSessionBody",
    "Refusal",
    "UpdateFromDiskBody",
    "ValidationError",
    "check_distributed_group",
    "check_distributed_update",
    "check_tensor_update",
]
