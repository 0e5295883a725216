"""One rule for text and numbers that come in over HTTP (docs/decisions.md, "Text and
numbers the database can hold"); the ranges of integer fields are `agentflow.integers`.

JSON as Python parses it admits more than either database stores or any error body can
echo: `NaN` and `Infinity` literals, number literals too big for a float or longer than
Python will turn into an int, the NUL character (PostgreSQL's text and JSON types refuse
it; SQLite keeps it) and lone UTF-16 surrogates (`"\\ud800"`, which no UTF-8 database can
encode). `parse_json` refuses all of them, naming where in the body each was found, so a
value that passes is stored the same, and read back equal, on SQLite and PostgreSQL.
`check_text` applies the same rule to path and query parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from agentflow.db.storable import text_problem
from agentflow.errors import InvalidInput

# Under CPython's own limit (4,300 digits) so int() never raises on a literal we accept.
MAX_INT_DIGITS = 4_000

Loc = tuple[str | int, ...]


class _Refused(ValueError):
    """A literal json.loads calls back about; it propagates out of the parser as is."""


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON (only finite numbers are)")


def _int(literal: str) -> int:
    if len(literal) - literal.startswith("-") > MAX_INT_DIGITS:
        raise _Refused(f"an integer literal of more than {MAX_INT_DIGITS} digits")
    return int(literal)


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"the number {literal[:40]} is out of range for a float")
    return value


def _field(loc: Loc) -> tuple[str, ...]:
    return tuple(str(part) for part in loc)


def check_text(value: str, loc: Loc) -> None:
    """Raise `InvalidInput` at `loc` when `value` cannot be stored as it is."""
    problem = text_problem(value)
    if problem is not None:
        raise InvalidInput(f"text {problem}", field=_field(loc))


def _strings(value: Any, loc: Loc) -> Iterator[tuple[str, Loc]]:
    """Every string in a parsed JSON value (keys included), with where it is."""
    stack: list[tuple[Any, Loc]] = [(value, loc)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            yield item, at
        elif isinstance(item, dict):
            for key, child in item.items():
                yield key, (*at, key)
                stack.append((child, (*at, key)))
        elif isinstance(item, list):
            stack.extend((child, (*at, i)) for i, child in enumerate(item))


def parse_json(raw: bytes, loc: Loc = ("body",)) -> Any:
    """`raw` as JSON under the rule above; `InvalidInput` naming the place otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"the body is not UTF-8: {exc.reason}", field=_field(loc)) from None
    try:
        value = json.loads(text, parse_constant=_constant, parse_int=_int, parse_float=_float)
    except _Refused as exc:
        raise InvalidInput(f"the body holds {exc}", field=_field(loc)) from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}", field=_field(loc)) from None
    except RecursionError:
        raise InvalidInput("the body is nested too deeply", field=_field(loc)) from None
    for string, at in _strings(value, loc):
        check_text(string, at)
    return value
