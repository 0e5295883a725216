import base64

import pytest
from pydantic import ValidationError

from envs.base import (
    ComputerAction,
    EnvError,
    InvalidAction,
    Observation,
    StepResult,
    TextAction,
    ToolCallsAction,
    parse_action,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8


def test_parse_action_each_type() -> None:
    assert parse_action({"type": "text", "text": "8"}) == TextAction(text="8")
    calls = parse_action(
        {"type": "tool_calls", "calls": [{"id": "c1", "name": "lookup", "arguments": {"k": 1}}]}
    )
    assert isinstance(calls, ToolCallsAction) and calls.calls[0].arguments == {"k": 1}
    assert parse_action({"type": "browser", "call": "click('12')"}).type == "browser"
    computer = parse_action({"type": "computer", "action_type": "CLICK", "parameters": {"x": 1}})
    assert isinstance(computer, ComputerAction)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "dance"},
        {"type": "text"},
        {"type": "text", "text": "x", "extra": 1},
        {"type": "tool_calls", "calls": []},
        {"type": "computer", "action_type": "EXPLODE"},
        "8",
        None,
    ],
)
def test_malformed_actions_raise_invalid_action(raw: object) -> None:
    with pytest.raises(InvalidAction) as info:
        parse_action(raw)
    assert info.value.status_code == 422
    assert isinstance(info.value, EnvError)


def test_observation_image_round_trips_as_base64() -> None:
    obs = Observation(image=PNG)
    dumped = obs.model_dump(mode="json")
    assert dumped["image"] == base64.b64encode(PNG).decode()
    assert Observation.model_validate(dumped).image == PNG
    assert Observation().model_dump(mode="json")["image"] is None


@pytest.mark.parametrize("bad", [b"GIF89a", "not base64!", base64.b64encode(b"JPEG").decode()])
def test_observation_rejects_non_png_images(bad: object) -> None:
    with pytest.raises(ValidationError):
        Observation(image=bad)  # type: ignore[arg-type]


def test_step_result_done() -> None:
    obs = Observation()
    assert not StepResult(observation=obs).done
    assert StepResult(observation=obs, terminated=True).done
    assert StepResult(observation=obs, truncated=True).done
