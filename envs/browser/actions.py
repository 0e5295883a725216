"""BrowserGym's action set, parsed with `ast` into calls with literal arguments only.

An agent's action is a call string such as ``click('12')`` or ``fill('7', "hello")``.
BrowserGym runs such strings with ``exec`` and ``page`` in scope; here nothing is ever
executed: the string is parsed as one Python expression, which must be a call of a name
from :data:`ACTIONS` whose arguments are literals (strings, numbers, booleans, lists of
strings). ``__import__('os')``, ``page.close()``, names, f-strings, comprehensions and
two statements are refused before anything touches the browser.

A refusal is an :class:`ActionError`: the model's mistake, which the env shows in the
next observation (``last_action_error``) rather than raising, so the episode goes on.

``goto`` is held to a :class:`GotoPolicy` (allowed schemes and hosts; by default the
task's own origin), so ``goto('file:///etc/passwd')`` is an action error.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MAX_TEXT = 2_000  # characters a fill/type action may carry


class ActionError(ValueError):
    """An action the env refused; its message is shown to the agent."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "bid" | "str" | "number" | "int" | "button" | "key" | "options" | "url"
    default: Any = ...

    @property
    def required(self) -> bool:
        return self.default is ...


def _p(name: str, kind: str, default: Any = ...) -> Param:
    return Param(name, kind, default)


ACTIONS: dict[str, tuple[Param, ...]] = {
    "click": (_p("bid", "bid"), _p("button", "button", "left")),
    "dblclick": (_p("bid", "bid"), _p("button", "button", "left")),
    "fill": (_p("bid", "bid"), _p("value", "str")),
    "select_option": (_p("bid", "bid"), _p("options", "options")),
    "press": (_p("bid", "bid"), _p("key_comb", "key")),
    "hover": (_p("bid", "bid"),),
    "focus": (_p("bid", "bid"),),
    "clear": (_p("bid", "bid"),),
    "scroll": (_p("delta_x", "number"), _p("delta_y", "number")),
    "mouse_click": (_p("x", "number"), _p("y", "number"), _p("button", "button", "left")),
    "mouse_move": (_p("x", "number"), _p("y", "number")),
    "keyboard_type": (_p("text", "str"),),
    "keyboard_press": (_p("key", "key"),),
    "goto": (_p("url", "url"),),
    "go_back": (),
    "new_tab": (),
    "tab_focus": (_p("index", "int"),),
    "send_msg_to_user": (_p("text", "str"),),
    "noop": (_p("wait_ms", "number", 0),),
}

BUTTONS = ("left", "right", "middle")
MODIFIERS = ("Alt", "Control", "ControlOrMeta", "Meta", "Shift")
_NAMED_KEYS = (
    "Backspace Tab Enter Escape Space PageUp PageDown End Home ArrowLeft ArrowUp "
    "ArrowRight ArrowDown Insert Delete CapsLock NumLock ScrollLock Pause ContextMenu"
).split() + [f"F{i}" for i in range(1, 13)]
KEYS: frozenset[str] = frozenset(
    [*_NAMED_KEYS, *MODIFIERS]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + [str(d) for d in range(10)]
    + list("`~!@#$%^&*()-_=+[]{};:'\",.<>/?\\| ")
    + [f"Key{chr(c)}" for c in range(ord("A"), ord("Z") + 1)]
    + [f"Digit{d}" for d in range(10)]
)
_BID = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


@dataclass(frozen=True)
class BrowserCall:
    """One parsed action: its name and its arguments by parameter name."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        inner = ", ".join(repr(v) for v in self.args.values())
        return f"{self.name}({inner})"


@dataclass(frozen=True)
class GotoPolicy:
    """Where ``goto`` may go: a URL whose scheme and host are both allowed."""

    schemes: frozenset[str] = frozenset({"http", "https"})
    hosts: frozenset[str] = frozenset()

    @classmethod
    def only(cls, urls: Iterable[str]) -> GotoPolicy:
        """The schemes and hosts of these URLs, nothing else."""
        parts = [urlsplit(u) for u in urls]
        return cls(frozenset(p.scheme for p in parts), frozenset(p.hostname or "" for p in parts))

    def check(self, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in self.schemes:
            raise ActionError(
                f"goto: scheme {parts.scheme or '(none)'!r} is not allowed "
                f"(allowed: {', '.join(sorted(self.schemes)) or 'none'})"
            )
        if (parts.hostname or "") not in self.hosts:
            raise ActionError(
                f"goto: host {parts.hostname or '(none)'!r} is not allowed "
                f"(allowed: {', '.join(sorted(self.hosts)) or 'none'})"
            )
        return url


def check_key(combo: str) -> str:
    """A Playwright key combination such as ``Enter`` or ``Control+a``."""
    if not combo or len(combo) > 64:
        raise ActionError(f"unknown key {combo!r}")
    if combo == "+" or combo.endswith("++"):  # the plus key itself, as Playwright writes it
        mods, key = (combo[:-2].split("+") if len(combo) > 1 else []), "+"
    else:
        *mods, key = combo.split("+")
    if any(m not in MODIFIERS for m in mods) or key not in KEYS:
        raise ActionError(f"unknown key {combo!r}: use names like 'Enter', 'Tab', 'a', 'Control+a'")
    return combo


def _literal(node: ast.expr, where: str) -> Any:
    """A literal argument: a constant, a negative number, or a list/tuple of constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        number = node.operand.value
        assert isinstance(number, int | float)
        return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.List | ast.Tuple) and len(node.elts) <= 64:
        return [_literal(e, where) for e in node.elts]
    raise ActionError(f"{where}: only literal arguments are allowed (strings, numbers)")


def _coerce(param: Param, value: Any, where: str) -> Any:
    kind = param.kind
    if kind == "bid":
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not _BID.match(value):
            raise ActionError(f"{where}: element id must be a string such as '12'")
        return value
    if kind in ("str", "url"):
        if not isinstance(value, str):
            raise ActionError(f"{where}: must be a string")
        if len(value) > MAX_TEXT:
            raise ActionError(f"{where}: longer than {MAX_TEXT} characters")
        return value
    if kind in ("number", "int"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ActionError(f"{where}: must be a number")
        if kind == "int" and not isinstance(value, int):
            raise ActionError(f"{where}: must be an integer")
        if abs(value) > 1e6:
            raise ActionError(f"{where}: out of range")
        return value
    if kind == "button":
        if value not in BUTTONS:
            raise ActionError(f"{where}: must be one of {', '.join(BUTTONS)}")
        return value
    if kind == "key":
        if not isinstance(value, str):
            raise ActionError(f"{where}: must be a key name string")
        return check_key(value)
    if kind == "options":
        values = [value] if isinstance(value, str) else value
        if (
            not isinstance(values, list)
            or not values
            or not all(isinstance(v, str) for v in values)
        ):
            raise ActionError(f"{where}: must be a string or a list of strings")
        return values
    raise AssertionError(kind)  # pragma: no cover - the table names only these kinds


def parse_call(text: str, goto: GotoPolicy | None = None) -> BrowserCall:
    """Parse one action string; :class:`ActionError` says what is wrong with it."""
    source = action_text(text)
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise ActionError(f"not a valid action call: {getattr(exc, 'msg', exc)}") from None
    call = tree.body
    if not isinstance(call, ast.Call):
        raise ActionError("an action is one call, such as click('12')")
    if not isinstance(call.func, ast.Name):
        raise ActionError("an action calls one of the actions by name (no attributes)")
    name = call.func.id
    params = ACTIONS.get(name)
    if params is None:
        raise ActionError(f"unknown action {name!r}; known: {', '.join(ACTIONS)}")
    if len(call.args) > len(params):
        raise ActionError(f"{name}() takes at most {len(params)} arguments")
    args: dict[str, Any] = {}
    for param, node in zip(params, call.args, strict=False):
        if isinstance(node, ast.Starred):
            raise ActionError(f"{name}: only literal arguments are allowed")
        args[param.name] = _coerce(param, _literal(node, f"{name}"), f"{name}: {param.name}")
    by_name = {p.name: p for p in params}
    for keyword in call.keywords:
        if keyword.arg is None or keyword.arg not in by_name:
            raise ActionError(f"{name}() has no argument {keyword.arg or '**'!r}")
        if keyword.arg in args:
            raise ActionError(f"{name}() got {keyword.arg!r} twice")
        param = by_name[keyword.arg]
        args[param.name] = _coerce(param, _literal(keyword.value, name), f"{name}: {param.name}")
    for param in params:
        if param.name not in args:
            if param.required:
                raise ActionError(f"{name}() needs its argument {param.name!r}")
            args[param.name] = param.default
    if name == "goto":
        (goto or GotoPolicy()).check(args["url"])
    if name == "noop" and not 0 <= args["wait_ms"] <= 5_000:
        raise ActionError("noop: wait_ms must be between 0 and 5000")
    ordered = {p.name: args[p.name] for p in params}
    return BrowserCall(name, ordered)


def action_text(text: str) -> str:
    """The call in an agent's reply: the reply stripped, without a code fence around it,
    and its first non-empty line when it has several (models often add a remark)."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        if body.startswith(("python\n", "py\n")):
            body = body.split("\n", 1)[1]
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if not lines:
        raise ActionError("empty action: reply with one call, such as click('12')")
    return lines[0]
