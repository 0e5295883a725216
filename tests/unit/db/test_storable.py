"""`storable_json`: JSON either database can hold, the same as walking the value first."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from agentflow.db.storable import storable, storable_json


@pytest.mark.parametrize(
    "value",
    [
        {"queue": 0.001, "generate": 0.25},
        {"na\x00me": 1.0, "text": "a\x00b"},
        {"obs": ["fine", {"deep": "lone \ud800 surrogate"}]},
        {"escaped": "a backslash, then u0000: \\u0000"},  # text, not a NUL: kept as sent
        [],
        "plain",
    ],
)
def test_storable_json_is_the_walked_value_serialized(value: Any) -> None:
    assert storable_json(value) == orjson.dumps(storable(value)).decode()


def test_what_no_json_holds_is_refused() -> None:
    with pytest.raises(TypeError):
        storable_json({"when": object()})
