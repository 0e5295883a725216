"""SGLang 0.5.23's wire format: our request types to its JSON bodies, its answers to ours.

Pinned to 0.5.23 because routes and fields moved between releases. The server runs with
`--skip-tokenizer-init` semantics: we send `input_ids`, never text, and read `output_ids`.

- `sampling_params` is strict on the server (an unknown key is a 400), so we send only keys
  0.5.23 knows: `temperature`, `top_p`, `max_new_tokens`, `stop_token_ids`,
  `sampling_seed`.
- Weight versions are strings on the wire (SGLang's default is `"default"`); the project
  counts them as integers, and `"default"` is version 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentflow.errors import EngineError
from agentflow.inference.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    VersionSpan,
)

DEFAULT_WEIGHT_VERSION = "default"


def generate_body(req: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for one request; log-probs always, of the output tokens only."""
    s = req.sampling
    sampling: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
    }
    if s.seed is not None:
        sampling["sampling_seed"] = s.seed
    body: dict[str, Any] = {
        "input_ids": list(req.input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": req.rid,
    }
    if req.session is not None:
        session: dict[str, Any] = {"id": req.session.session_id}
        if req.session.parent_rid is not None:
            session["rid"] = req.session.parent_rid
        if req.session.offset is not None:
            session["offset"] = req.session.offset
        body["session_params"] = session
    return body


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
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineError(f"malformed /generate answer: {exc}") from exc


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
    )


def disk_update_body(model_path: str, version: int) -> dict[str, Any]:
    return {"model_path": model_path, "weight_version": version_to_wire(version)}


def distributed_group_body(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
) -> dict[str, Any]:
    if not 0 < rank_offset < world_size:
        raise ValueError("rank_offset must be in (0, world_size): the trainer is rank 0")
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


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
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty and of equal length")
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": [d.removeprefix("torch.") for d in dtypes],
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": version_to_wire(version),
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


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
    if not serialized_named_tensors:
        raise ValueError("serialized_named_tensors must hold one payload per TP rank")
    body: dict[str, Any] = {
        "serialized_named_tensors": list(serialized_named_tensors),
        "flush_cache": flush_cache,
        "weight_version": version_to_wire(version),
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body
