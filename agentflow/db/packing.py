"""Token arrays packed as little-endian bytes, identical on SQLite and PostgreSQL.

A turn's arrays are packed as it is written, a few dozen values each: the standard
library's `array` does that in about two thirds of numpy's time (numpy's cost is
mostly fixed per call), where this machine's int32 and float32 are the stored
little-endian ones; numpy elsewhere. Unpacking (whole paths at once) stays numpy's.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
_UINT8 = np.dtype("u1")
_NATIVE = (
    sys.byteorder == "little" and array.array("i").itemsize == 4 and array.array("f").itemsize == 4
)


def pack_ints(values: Sequence[int]) -> bytes:
    if _NATIVE:
        return array.array("i", values).tobytes()
    return np.asarray(values, dtype=_INT32).tobytes()


def unpack_ints(data: bytes | None) -> list[int]:
    return [] if not data else np.frombuffer(data, dtype=_INT32).tolist()


def int_view(data: bytes) -> Sequence[int]:
    """Packed ints read in place where they are this machine's own (cheaper than numpy for
    a turn's few dozen), else unpacked."""
    if _NATIVE:
        return memoryview(data).cast("i")
    return unpack_ints(data)


def pack_floats(values: Sequence[float]) -> bytes:
    if _NATIVE:
        return array.array("f", values).tobytes()
    return np.asarray(values, dtype=_FLOAT32).tobytes()


def unpack_floats(data: bytes | None) -> list[float]:
    return [] if not data else np.frombuffer(data, dtype=_FLOAT32).tolist()


def pack_mask(values: Sequence[bool | int]) -> bytes:
    if isinstance(values, list | tuple):
        return bytes(values)  # each 0 or 1: one byte each
    return np.asarray(values, dtype=_UINT8).tobytes()


def unpack_mask(data: bytes | None) -> list[int]:
    return [] if not data else np.frombuffer(data, dtype=_UINT8).tolist()
