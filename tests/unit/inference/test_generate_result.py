"""An engine's answer is checked where it comes in: what a turn record would refuse is
refused by `GenerateResult`, and a wire parser turns that into an `EngineError`."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from agentflow.errors import EngineError
from agentflow.inference.base import GenerateResult, VersionSpan
from agentflow.inference.sglang_wire import parse_generate


def result(**overrides: Any) -> GenerateResult:
    fields: dict[str, Any] = {
        "rid": "r",
        "output_ids": [5, 6],
        "logprobs": [-0.5, -1.0],
        "finish_reason": "stop",
        "weight_versions": [VersionSpan(version=2, start=0, end=2)],
        "prompt_tokens": 3,
    }
    return GenerateResult(**(fields | overrides))


def test_a_sound_answer_passes() -> None:
    assert result().token_versions() == [2, 2]
    assert result(output_ids=[0, 2**31 - 1]).output_ids == [0, 2**31 - 1]


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("output_ids", {"output_ids": [5, -1]}),
        ("output_ids", {"output_ids": [5, 2**31]}),
        ("logprobs", {"logprobs": [-0.5, float("nan")]}),
        ("logprobs", {"logprobs": [float("-inf"), -0.5]}),
        ("logprobs", {"logprobs": [-0.5, -1e39]}),  # past float32, the stored width
    ],
)
def test_what_a_turn_could_not_hold_is_refused(field: str, overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as caught:
        result(**overrides)
    assert caught.value.errors()[0]["loc"][0] == field


def test_a_negative_weight_version_is_refused() -> None:
    with pytest.raises(ValidationError):
        VersionSpan(version=-1, start=0, end=1)


def test_a_wire_answer_with_a_nan_log_prob_is_an_engine_error() -> None:
    answer = {
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r",
            "prompt_tokens": 3,
            "finish_reason": {"type": "stop"},
            "weight_version": "1",
            "output_token_logprobs": [[-0.5, 5, None], [float("nan"), 6, None]],
        },
    }
    with pytest.raises(EngineError, match="malformed"):
        parse_generate(answer, "r")
    answer["meta_info"]["output_token_logprobs"][1][0] = -0.25  # type: ignore[index]
    assert parse_generate(answer, "r").logprobs == [-0.5, -0.25]
