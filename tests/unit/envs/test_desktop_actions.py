"""OSWorld `computer_13` validation: every field, every refusal, and a fuzz that finds
no error but the module's own."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.base import ComputerAction
from envs.desktop.actions import (
    ACTION_TYPES,
    FIELDS,
    KEYS,
    MAX_HOTKEY_KEYS,
    MAX_SCROLL,
    MAX_TEXT_CHARS,
    ActionError,
    action_from_text,
    validate,
)

SCREEN = (800, 600)


def play(action_type: str, **params: Any):
    return validate(ComputerAction(action_type=action_type, parameters=params), SCREEN)  # type: ignore[arg-type]


def refused(action_type: str, match: str, **params: Any) -> None:
    with pytest.raises(ActionError, match=match):
        play(action_type, **params)


def test_every_action_type_has_its_fields() -> None:
    assert set(FIELDS) == set(ACTION_TYPES)


def test_pointer_actions() -> None:
    assert play("MOVE_TO", x=0, y=599).x == 0
    click = play("CLICK", button="middle", x=799, y=10, num_clicks=3)
    assert (click.button, click.x, click.y, click.clicks) == ("middle", 799, 10, 3)
    assert play("CLICK") == play("CLICK", button="left", num_clicks=1)
    assert play("CLICK").x is None  # where the pointer is
    assert play("RIGHT_CLICK", x=5, y=6).button == "right"
    assert play("DOUBLE_CLICK").clicks == 2
    assert play("MOUSE_DOWN", button="right").button == "right"
    assert play("MOUSE_UP").button == "left"
    assert (play("DRAG_TO", x=1, y=2).x, play("DRAG_TO", x=1, y=2).y) == (1, 2)
    scroll = play("SCROLL", dx=-MAX_SCROLL, dy=MAX_SCROLL)
    assert (scroll.dx, scroll.dy) == (-MAX_SCROLL, MAX_SCROLL)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"x": 800, "y": 0}, r"x=800 is outside 0..799"),
        ({"x": 0, "y": 600}, r"y=600 is outside 0..599"),
        ({"x": -1, "y": 0}, "outside"),
        ({"x": 1.0, "y": 0}, "x must be an integer"),
        ({"x": True, "y": 0}, "x must be an integer"),
        ({"x": "1", "y": 0}, "x must be an integer"),
        ({"x": 1}, "x and y go together"),
        ({"y": 1}, "x and y go together"),
        ({"button": "LEFT"}, "button must be one of"),
        ({"button": "left'); import os; os.system('x"}, "button must be one of"),
        ({"button": 1}, "button must be one of"),
        ({"num_clicks": 0}, "outside 1..3"),
        ({"num_clicks": 4}, "outside 1..3"),
        ({"num_clicks": 2.0}, "must be an integer"),
        ({"clicks": 2}, "unknown parameter"),
    ],
)
def test_click_refusals(params: dict[str, Any], match: str) -> None:
    refused("CLICK", match, **params)


def test_required_and_unknown_parameters() -> None:
    refused("MOVE_TO", r"missing parameter\(s\) \['x', 'y'\]")
    refused("DRAG_TO", r"missing parameter\(s\) \[.y.\]", x=1)
    refused("SCROLL", "missing", dx=1)
    refused("SCROLL", "outside", dx=MAX_SCROLL + 1, dy=0)
    refused("TYPING", "missing")
    refused("PRESS", "missing")
    refused("HOTKEY", "missing")
    refused("MOUSE_DOWN", "unknown parameter", x=1, y=1)
    refused("RIGHT_CLICK", "unknown parameter", button="left")
    for kind in ("WAIT", "FAIL", "DONE"):
        assert play(kind).action_type == kind
        refused(kind, "allowed: none", seconds=1)
    for kind, fields in FIELDS.items():
        refused(kind, "unknown parameter", **{name: 1 for name in fields}, extra=1)


def test_typing() -> None:
    assert play("TYPING", text="echo hi > ~/a.txt\n\t|&$").text == "echo hi > ~/a.txt\n\t|&$"
    assert len(play("TYPING", text="x" * MAX_TEXT_CHARS).text) == MAX_TEXT_CHARS
    refused("TYPING", "longer than", text="x" * (MAX_TEXT_CHARS + 1))
    refused("TYPING", "non-empty string", text="")
    refused("TYPING", "non-empty string", text=5)
    refused("TYPING", "printable ASCII", text="héllo")
    refused("TYPING", "printable ASCII", text="a\x1bb")


def test_keys() -> None:
    assert play("PRESS", key="enter").keys == ("Enter",)
    assert play("PRESS", key="Enter").keys == ("Enter",)  # names are case-insensitive
    assert play("PRESS", key="A").keys == ("A",)  # single characters are not
    assert play("KEY_DOWN", key="ctrl").keys == ("Control",)
    assert play("KEY_UP", key="shiftright").keys == ("ShiftRight",)
    assert play("PRESS", key="f12").keys == ("F12",)
    assert play("HOTKEY", keys=["ctrl", "alt", "t"]).keys == ("Control", "Alt", "t")
    refused("PRESS", "unknown key", key="f13")
    refused("PRESS", "unknown key", key="launchapp1")
    refused("PRESS", "unknown key", key="")
    refused("PRESS", "a key must be a string", key=13)
    refused("HOTKEY", "list of 1-", keys=[])
    refused("HOTKEY", "list of 1-", keys="ctrl+c")
    refused("HOTKEY", "list of 1-", keys=["a"] * (MAX_HOTKEY_KEYS + 1))
    refused("HOTKEY", "unknown key", keys=["ctrl", "nope"])
    assert all(isinstance(v, str) and v for v in KEYS.values())


def test_text_replies() -> None:
    action = action_from_text('{"action_type": "CLICK", "parameters": {"x": 1, "y": 2}}')
    assert action == ComputerAction(action_type="CLICK", parameters={"x": 1, "y": 2})
    fenced = '```json\n{"type": "computer", "action_type": "DONE"}\n```'
    assert action_from_text(fenced).action_type == "DONE"
    with pytest.raises(ActionError, match="not a JSON computer action"):
        action_from_text("click the terminal")
    with pytest.raises(ActionError, match="one JSON object"):
        action_from_text("[1, 2]")
    with pytest.raises(ActionError, match="action_type"):
        action_from_text('{"action_type": "EXPLODE"}')
    with pytest.raises(ActionError, match="not a computer action"):
        action_from_text('{"action_type": "DONE", "why": "done"}')
    with pytest.raises(ActionError, match="not a computer action"):
        action_from_text('{"type": "browser", "action_type": "DONE"}')


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_names = st.sampled_from(sorted({name for fields in FIELDS.values() for name in fields}))
_params = st.dictionaries(_names | st.text(max_size=6), _json | st.integers(-2, 900), max_size=5)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(ACTION_TYPES) | st.text(max_size=10), params=_params)
def test_fuzz_validate_raises_only_action_error(kind: str, params: dict[str, Any]) -> None:
    action = ComputerAction.model_construct(action_type=kind, parameters=params)
    try:
        command = validate(action, SCREEN)
    except ActionError:
        return
    assert command.action_type == kind
    for coordinate, limit in ((command.x, SCREEN[0]), (command.y, SCREEN[1])):
        assert coordinate is None or 0 <= coordinate < limit


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60) | _json.map(json.dumps))
def test_fuzz_text_replies_raise_only_action_error(text: str) -> None:
    try:
        action = action_from_text(text)
    except ActionError:
        return
    assert isinstance(action, ComputerAction)
