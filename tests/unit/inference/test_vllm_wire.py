"""vLLM 0.32's answers read into ours, and checkpoints compared by their headers; the
answers here are shaped as the real server gave them (tests/integration/inference/vllm
checks the same against the server itself)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from agentflow.errors import EngineError
from agentflow.inference import vllm_wire as wire
from agentflow.inference.base import SamplingParams


def _answer(ids: list[int], spans: Any, tops: list[list[tuple[int, float, int]]] | None = None):
    content = []
    for i, token in enumerate(ids):
        entry: dict[str, Any] = {"token_id": token, "logprob": -0.5 - i, "rank": 3}
        if tops is not None:
            entry["top_logprobs"] = [
                {"token_id": t, "logprob": lp, "rank": r} for t, lp, r in tops[i]
            ]
        content.append(entry)
    return {
        "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}},
        "choices": [
            {
                "finish_reason": "length",
                "token_ids": ids,
                "weight_versions": spans,
                "logprobs": {"content": content},
            }
        ],
    }


def test_an_answer_with_split_spans() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    result = wire.parse_generate(
        _answer([5, 6, 7], spans), "r", prompt_tokens=7, top_k=0, version=0
    )
    assert result.output_ids == [5, 6, 7] and result.logprobs == [-0.5, -1.5, -2.5]
    assert result.token_versions() == [0, 0, 3]
    assert (result.prompt_tokens, result.cached_tokens) == (7, 4)


def test_spans_missing_take_the_clients_version() -> None:
    result = wire.parse_generate(_answer([5], None), "r", prompt_tokens=7, top_k=0, version=4)
    assert result.token_versions() == [4]


def test_top_logprobs_are_the_k_best_by_rank() -> None:
    # vLLM lists the sampled token first (rank 9 here), then the most likely ones.
    tops = [[(5, -3.0, 9), (8, -0.1, 1), (9, -0.2, 2)]]
    result = wire.parse_generate(_answer([5], None, tops), "r", prompt_tokens=7, top_k=2, version=0)
    assert result.top_logprobs == [[(8, -0.1), (9, -0.2)]]
    body = wire.generate_body("r", [1, 2], SamplingParams(top_logprobs=2), None)
    assert body["sampling_params"]["logprobs"] == 3


def test_a_logprob_of_another_token_is_an_error() -> None:
    answer = _answer([5, 6], None)
    answer["choices"][0]["logprobs"]["content"][1]["token_id"] = 9
    with pytest.raises(EngineError, match="log-prob entry 1"):
        wire.parse_generate(answer, "r", prompt_tokens=7, top_k=0, version=0)


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    path.mkdir()
    header = {n: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for n, s in tensors.items()}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_checkpoints_compared_by_their_headers(tmp_path: Path) -> None:
    _safetensors(tmp_path / "a", {"w": [2, 3], "b": [3]})
    _safetensors(tmp_path / "b", {"w": [2, 4], "c": [3]})
    served = wire.checkpoint_tensors(tmp_path / "a")
    assert served == {"w": ("F32", (2, 3)), "b": ("F32", (3,))}
    wire.compare_checkpoints(served, served, "same")
    with pytest.raises(EngineError) as misfit:
        wire.compare_checkpoints(served, wire.checkpoint_tensors(tmp_path / "b"), "b")
    assert "missing ['b']" in str(misfit.value) and "w (2, 4) vs served (2, 3)" in str(misfit.value)
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        wire.checkpoint_tensors(tmp_path)
