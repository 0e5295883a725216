"""Text either database can hold, the same on SQLite and PostgreSQL.

PostgreSQL's text and JSON types refuse the NUL character (SQLite keeps it), and no
UTF-8 database can encode a lone UTF-16 surrogate. Text that comes in over the API is
refused with a 422 naming the field when it holds either (`agentflow.api.strict_json`),
so what a caller sends is stored as sent. Text the system writes itself (an env's
observation, an exception's message, a task an env made up) cannot be refused by anyone,
so `StorableText` and `StorableJSON` write each such character as U+FFFD: the row is
stored, on both databases alike, rather than the write failing and the episode's record
being lost with it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from sqlalchemy import JSON, Text, TypeDecorator
from sqlalchemy.engine import Dialect

UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def text_problem(value: str) -> str | None:
    """Why the database cannot hold `value` as it is, or None when it can."""
    found = UNSTORABLE.search(value)
    if found is None:
        return None
    if found.group() == "\x00":
        return "contains a NUL character (U+0000), which the database cannot store"
    return f"contains a lone surrogate (U+{ord(found.group()):04X}), which is not valid Unicode"


def storable(value: Any) -> Any:
    """`value` with every unstorable character in every string (keys too) replaced."""
    if isinstance(value, str):
        return UNSTORABLE.sub(REPLACEMENT, value) if UNSTORABLE.search(value) else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def storable_json(value: Any) -> str:
    """`value` as JSON text either database can hold (`storable`'s replacements made).
    Serialized first, and walked only when that shows an unstorable character: orjson
    writes a NUL as the escape `\\u0000` and refuses a lone surrogate, and the walk costs
    more than the serializing (a turn's timings, an episode's task, on every write)."""
    try:
        dumped = orjson.dumps(value)
    except orjson.JSONEncodeError:  # a lone surrogate (or what no JSON holds: raised below)
        return orjson.dumps(storable(value)).decode()
    if b"\\u0000" in dumped:
        return orjson.dumps(storable(value)).decode()
    return dumped.decode()


class StorableText(TypeDecorator[str]):
    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable(value)


class StorableJSON(TypeDecorator[Any]):
    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return storable(value)
