"""One rule for the integers that come in over the API, as `api.strict_json` is for text
(docs/decisions.md, "Text and numbers the database can hold").

PostgreSQL's `integer` column holds 32 bits and refuses a wider value at the write (a 500,
where SQLite, whose INTEGER holds 64 bits, stored it); past 64 bits both fail (SQLite's
driver cannot bind the value, PostgreSQL's `bigint`, LIMIT and OFFSET cannot hold it), and
so does torch given such a seed. So every integer field of the API (body, path or query)
has one of two types, and a value outside its range is a 422 naming the field, the same
on both databases:

- `Int32`: a value stored in an `Integer` column or compared with one (a weight version,
  an env's concurrency), or one that becomes such a value (a trainer's step count is its
  last weight version; token arrays pack weight versions as 32-bit integers too);
- `Int64`: every other integer (a LIMIT or OFFSET, a seed, a size or count that is kept in
  a JSON column, which holds any integer, and used by code that holds 64 bits).

A field's own bounds narrow its type's, however they are written (`version: Int32 =
Field(ge=1)`, `Annotated[Int64, Query(ge=0)]`). The range is a constraint of the core
schema, so the OpenAPI schema shows it and validation costs nothing more.

Pydantic's lax reading of integers is kept, the same for every field: a float with no
fractional part is its integer (`3.0` is 3: clients that only have doubles send those), a
float with one is refused, and `true` and `false` are 1 and 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, cast

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Within:
    """`Annotated` metadata: the integer lies in [low, high], inside any bounds of its own."""

    low: int
    high: int

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        schema = handler(source)
        if schema["type"] != "int":
            raise TypeError(f"Within bounds an int, not a {schema['type']} schema")
        bounded = cast(core_schema.IntSchema, schema)
        # A bound written on the field itself may come before this one (`= Field(ge=1)`
        # does): the narrower of the two holds either way, never the last one written.
        bounded["ge"] = max(bounded.get("ge", self.low), self.low)
        bounded["le"] = min(bounded.get("le", self.high), self.high)
        return bounded


Int32 = Annotated[int, Within(INT32_MIN, INT32_MAX)]
Int64 = Annotated[int, Within(INT64_MIN, INT64_MAX)]
