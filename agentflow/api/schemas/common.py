from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel, Field

Item = TypeVar("Item")


class Page(BaseModel, Generic[Item]):
    items: list[Item]
    total: int = Field(description="matching rows in all pages")
    limit: int
    offset: int
