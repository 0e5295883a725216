"""Token arrays packed as little-endian bytes, identical on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
_UINT8 = np.dtype("u1")


def pack_ints(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype=_INT32).tobytes()


def unpack_ints(data: bytes | None) -> list[int]:
    return [] if not data else np.frombuffer(data, dtype=_INT32).tolist()


def pack_floats(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype=_FLOAT32).tobytes()


def unpack_floats(data: bytes | None) -> list[float]:
    return [] if not data else np.frombuffer(data, dtype=_FLOAT32).tolist()


def pack_mask(values: Sequence[bool | int]) -> bytes:
    return np.asarray(values, dtype=_UINT8).tobytes()


def unpack_mask(data: bytes | None) -> list[int]:
    return [] if not data else np.frombuffer(data, dtype=_UINT8).tolist()
