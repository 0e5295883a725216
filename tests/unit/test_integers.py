"""`agentflow.integers`: the 32- and 64-bit ranges hold however a field adds its own bounds,
and pydantic's lax reading of integers is kept."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from agentflow.integers import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, Int32, Int64, Within


class Fields(BaseModel):
    plain: Int32 = 0
    assigned: Int32 = Field(default=1, ge=1)  # the field's bound is seen before the range's
    annotated: Annotated[Int64, Field(ge=0, le=500)] = 0  # and after it here
    wider: Int32 = Field(default=0, le=2**40)  # a bound past the range: the range holds
    optional: Int64 | None = Field(default=None, ge=1)
    nested: list[list[Int64]] = []


def _refused(**values: object) -> list[tuple[object, ...]]:
    with pytest.raises(ValidationError) as refused:
        Fields(**values)
    return [tuple(e["loc"]) for e in refused.value.errors()]


def test_each_type_takes_its_range_and_nothing_past_it() -> None:
    for kind, low, high in ((Int32, INT32_MIN, INT32_MAX), (Int64, INT64_MIN, INT64_MAX)):
        adapter: TypeAdapter[int] = TypeAdapter(kind)
        assert adapter.validate_python(low) == low and adapter.validate_python(high) == high
        for past in (low - 1, high + 1, 10**30):
            with pytest.raises(ValidationError):
                adapter.validate_python(past)
    assert (INT32_MIN, INT32_MAX) == (-2147483648, 2147483647)
    assert (INT64_MIN, INT64_MAX) == (-9223372036854775808, 9223372036854775807)


def test_a_fields_own_bounds_narrow_the_range_in_either_order() -> None:
    assert Fields(plain=INT32_MAX, assigned=INT32_MAX, annotated=500, wider=INT32_MAX)
    assert _refused(assigned=0) == [("assigned",)]
    assert _refused(assigned=INT32_MAX + 1) == [("assigned",)]
    assert _refused(annotated=501) == [("annotated",)]
    assert _refused(annotated=-1) == [("annotated",)]
    assert _refused(wider=INT32_MAX + 1) == [("wider",)]
    assert _refused(optional=0) == [("optional",)]
    assert _refused(optional=INT64_MAX + 1) == [("optional",)]
    assert _refused(nested=[[1, INT64_MAX + 1]]) == [("nested", 0, 1)]


def test_the_schema_shows_each_range() -> None:
    properties = Fields.model_json_schema()["properties"]
    assert (properties["plain"]["minimum"], properties["plain"]["maximum"]) == (
        INT32_MIN,
        INT32_MAX,
    )
    assert (properties["assigned"]["minimum"], properties["assigned"]["maximum"]) == (
        1,
        INT32_MAX,
    )
    assert (properties["annotated"]["minimum"], properties["annotated"]["maximum"]) == (0, 500)
    assert properties["wider"]["maximum"] == INT32_MAX
    assert properties["optional"]["anyOf"][0]["maximum"] == INT64_MAX
    assert properties["nested"]["items"]["items"]["minimum"] == INT64_MIN


def test_pydantics_lax_integers_are_kept() -> None:
    adapter: TypeAdapter[int] = TypeAdapter(Int64)
    assert adapter.validate_python(40234300348437.0) == 40234300348437
    assert type(adapter.validate_python(3.0)) is int
    assert adapter.validate_python(True) == 1 and adapter.validate_python(False) == 0
    assert adapter.validate_python("7") == 7  # a query parameter's text
    with pytest.raises(ValidationError, match="fractional part"):
        adapter.validate_python(1.5)
    with pytest.raises(ValidationError):  # integral, but past 32 bits
        TypeAdapter(Int32).validate_python(40234300348437.0)


def test_a_range_on_anything_but_an_integer_is_a_mistake() -> None:
    with pytest.raises(TypeError, match="bounds an int"):
        TypeAdapter(Annotated[str, Within(0, 1)])
