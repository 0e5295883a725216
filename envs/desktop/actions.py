"""OSWorld `computer_13` actions, validated field by field before anything is played.

OSWorld pastes `button`, `x`, `y` unchecked into pyautogui code strings; here every
action becomes a typed :class:`DesktopCommand` or an :class:`ActionError` whose message
the agent sees in its next observation (a policy must see its mistakes; the episode goes
on). The fields, as OSWorld documents them (`?` = optional)::

    MOVE_TO(x, y)            CLICK(button?, x?, y?, num_clicks? 1-3)
    MOUSE_DOWN(button?)      MOUSE_UP(button?)
    RIGHT_CLICK(x?, y?)      DOUBLE_CLICK(x?, y?)       DRAG_TO(x, y)
    SCROLL(dx, dy)           TYPING(text)
    PRESS(key)  KEY_DOWN(key)  KEY_UP(key)              HOTKEY(keys)
    WAIT  FAIL  DONE

Coordinates are ints on the screen (`0 <= x < width`), `x` and `y` come together,
buttons are left/right/middle, keys come from :data:`KEYS` (pyautogui's names that a
VNC keyboard can send, plus single printable ASCII characters), text is printable ASCII
with newlines and tabs (Playwright types anything else without key events, which noVNC
never sees) and at most :data:`MAX_TEXT_CHARS` long. Unknown parameters are refused.

White-box agents answer in text: :func:`action_from_text` reads a `TextAction` whose
text is one JSON object, `{"action_type": "CLICK", "parameters": {...}}` (`"type":
"computer"` optional), bare or inside a ```json fence.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import ValidationError

from envs.base import ComputerAction, ComputerActionType

MAX_TEXT_CHARS = 2_000
MAX_SCROLL = 50  # wheel clicks per SCROLL, each way
MAX_HOTKEY_KEYS = 5
BUTTONS = ("left", "right", "middle")
ACTION_TYPES: tuple[str, ...] = get_args(ComputerActionType)

_NAMED_KEYS = {
    "alt": "Alt", "altleft": "AltLeft", "altright": "AltRight",
    "option": "Alt", "optionleft": "AltLeft", "optionright": "AltRight",
    "backspace": "Backspace", "capslock": "CapsLock",
    "ctrl": "Control", "ctrlleft": "ControlLeft", "ctrlright": "ControlRight",
    "del": "Delete", "delete": "Delete", "insert": "Insert",
    "down": "ArrowDown", "up": "ArrowUp", "left": "ArrowLeft", "right": "ArrowRight",
    "end": "End", "home": "Home", "pagedown": "PageDown", "pgdn": "PageDown",
    "pageup": "PageUp", "pgup": "PageUp",
    "enter": "Enter", "return": "Enter", "\n": "Enter", "\r": "Enter",
    "esc": "Escape", "escape": "Escape", "tab": "Tab", "\t": "Tab",
    "space": " ", "shift": "Shift", "shiftleft": "ShiftLeft", "shiftright": "ShiftRight",
    "win": "Meta", "winleft": "MetaLeft", "winright": "MetaRight", "command": "Meta",
    "pause": "Pause", "numlock": "NumLock", "scrolllock": "ScrollLock",
    "print": "PrintScreen", "printscreen": "PrintScreen", "prntscrn": "PrintScreen",
    "prtsc": "PrintScreen", "prtscr": "PrintScreen",
    "add": "NumpadAdd", "subtract": "NumpadSubtract", "multiply": "NumpadMultiply",
    "divide": "NumpadDivide", "decimal": "NumpadDecimal",
}  # fmt: skip
#: OSWorld (pyautogui) key name -> the Playwright key that sends it through noVNC.
KEYS: dict[str, str] = {
    **{c: c for c in string.digits + string.ascii_letters + string.punctuation + " "},
    **{f"num{d}": f"Numpad{d}" for d in range(10)},
    **{f"f{n}": f"F{n}" for n in range(1, 13)},
    **_NAMED_KEYS,
}
_TYPABLE = frozenset(string.printable) - frozenset("\r\x0b\x0c")

#: Each action's parameters: name -> required.
FIELDS: dict[str, dict[str, bool]] = {
    "MOVE_TO": {"x": True, "y": True},
    "CLICK": {"button": False, "x": False, "y": False, "num_clicks": False},
    "MOUSE_DOWN": {"button": False},
    "MOUSE_UP": {"button": False},
    "RIGHT_CLICK": {"x": False, "y": False},
    "DOUBLE_CLICK": {"x": False, "y": False},
    "DRAG_TO": {"x": True, "y": True},
    "SCROLL": {"dx": True, "dy": True},
    "TYPING": {"text": True},
    "PRESS": {"key": True},
    "KEY_DOWN": {"key": True},
    "KEY_UP": {"key": True},
    "HOTKEY": {"keys": True},
    "WAIT": {},
    "FAIL": {},
    "DONE": {},
}


class ActionError(ValueError):
    """An action that cannot be played; its message goes to the agent."""


@dataclass(frozen=True)
class DesktopCommand:
    """A validated action: what the noVNC driver plays (envs/desktop/novnc.py)."""

    action_type: str
    x: int | None = None  # None: where the pointer is
    y: int | None = None
    button: str = "left"
    clicks: int = 1
    dx: int = 0
    dy: int = 0  # wheel clicks, pyautogui's sign: positive scrolls up
    text: str = ""
    keys: tuple[str, ...] = ()  # Playwright key names

    @property
    def ends_episode(self) -> bool:
        return self.action_type in ("DONE", "FAIL")


def validate(action: ComputerAction, screen: tuple[int, int]) -> DesktopCommand:
    """The command `action` asks for on a `screen` (width, height); else ActionError."""
    kind = action.action_type
    if kind not in FIELDS:
        raise ActionError(f"unknown action_type {kind!r}; expected one of {ACTION_TYPES}")
    params = action.parameters
    if not isinstance(params, dict):
        raise ActionError(f"{kind}: parameters must be an object")
    fields = FIELDS[kind]
    unknown = sorted(str(k) for k in params if k not in fields)
    if unknown:
        allowed = ", ".join(fields) or "none"
        raise ActionError(f"{kind}: unknown parameter(s) {unknown}; allowed: {allowed}")
    missing = [name for name, required in fields.items() if required and name not in params]
    if missing:
        raise ActionError(f"{kind}: missing parameter(s) {missing}")
    if ("x" in params) != ("y" in params):
        raise ActionError(f"{kind}: x and y go together")
    width, height = screen
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name == "x":
            out["x"] = _int(kind, name, value, 0, width - 1)
        elif name == "y":
            out["y"] = _int(kind, name, value, 0, height - 1)
        elif name == "button":
            if value not in BUTTONS:
                raise ActionError(f"{kind}: button must be one of {BUTTONS}, not {_show(value)}")
            out["button"] = value
        elif name == "num_clicks":
            out["clicks"] = _int(kind, name, value, 1, 3)
        elif name in ("dx", "dy"):
            out[name] = _int(kind, name, value, -MAX_SCROLL, MAX_SCROLL)
        elif name == "text":
            out["text"] = _text(kind, value)
        elif name == "key":
            out["keys"] = (_key(kind, value),)
        elif name == "keys":
            if not isinstance(value, list) or not 1 <= len(value) <= MAX_HOTKEY_KEYS:
                raise ActionError(f"{kind}: keys must be a list of 1-{MAX_HOTKEY_KEYS} keys")
            out["keys"] = tuple(_key(kind, k) for k in value)
    if kind == "RIGHT_CLICK":
        out["button"] = "right"
    elif kind == "DOUBLE_CLICK":
        out["clicks"] = 2
    return DesktopCommand(action_type=kind, **out)


def action_from_text(text: str) -> ComputerAction:
    """A white-box agent's reply read as one computer action; else ActionError."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL)
    if fenced:
        body = fenced.group(1)
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        raise ActionError(
            'the reply is not a JSON computer action like {"action_type": "CLICK", '
            '"parameters": {"x": 10, "y": 20}}'
        ) from None
    if not isinstance(raw, dict):
        raise ActionError("the reply must be one JSON object (a computer action)")
    raw.setdefault("type", "computer")
    try:
        return ComputerAction.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "action"
        raise ActionError(f"not a computer action: {where}: {first['msg']}") from None


def _int(kind: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ActionError(f"{kind}: {name} must be an integer, not {_show(value)}")
    if not low <= value <= high:
        raise ActionError(f"{kind}: {name}={value} is outside {low}..{high}")
    return value


def _text(kind: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ActionError(f"{kind}: text must be a non-empty string")
    if len(value) > MAX_TEXT_CHARS:
        raise ActionError(f"{kind}: text is longer than {MAX_TEXT_CHARS} characters")
    bad = sorted(set(value) - _TYPABLE)
    if bad:
        raise ActionError(f"{kind}: only printable ASCII can be typed, not {bad[:5]!r}")
    return value


def _key(kind: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ActionError(f"{kind}: a key must be a string, not {_show(value)}")
    found = KEYS.get(value) if len(value) == 1 else KEYS.get(value.lower())
    if found is None:
        raise ActionError(f"{kind}: unknown key {_show(value)} (pyautogui key names)")
    return found


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
