"""Packed token arrays: exact little-endian bytes, identical on every database."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from agentflow.db import packing
from agentflow.db.packing import (
    pack_floats,
    pack_ints,
    pack_mask,
    unpack_floats,
    unpack_ints,
    unpack_mask,
)

int32s = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64)
float32s = st.lists(st.floats(width=32, allow_nan=False), max_size=64)


def test_bytes_are_little_endian_whatever_the_host() -> None:
    assert pack_ints([1, -1, 2**31 - 1]) == struct.pack("<3i", 1, -1, 2**31 - 1)
    assert pack_floats([-0.5, 1.0]) == struct.pack("<2f", -0.5, 1.0)
    assert pack_mask([0, 1, 1]) == b"\x00\x01\x01"


def test_empty_and_missing_arrays_unpack_to_empty_lists() -> None:
    for unpack in (unpack_ints, unpack_floats, unpack_mask):
        assert unpack(b"") == []
        assert unpack(None) == []


@given(int32s)
def test_ints_round_trip(values: list[int]) -> None:
    packed = pack_ints(values)
    assert len(packed) == 4 * len(values)
    assert unpack_ints(packed) == values


@given(float32s)
def test_float32_values_round_trip_bit_for_bit(values: list[float]) -> None:
    back = unpack_floats(pack_floats(values))
    assert np.array(back, dtype="<f4").tobytes() == np.array(values, dtype="<f4").tobytes()
    assert back == values


@given(st.lists(st.integers(0, 1), max_size=64))
def test_masks_round_trip(values: list[int]) -> None:
    assert unpack_mask(pack_mask(values)) == values


@given(int32s, float32s, st.lists(st.integers(0, 1), max_size=64))
def test_the_array_and_numpy_paths_pack_the_same_bytes(
    ints: list[int], floats: list[float], mask: list[int]
) -> None:
    """`array` where this machine's int32 and float32 are the stored little-endian ones,
    numpy elsewhere: the same bytes either way."""
    fast = (pack_ints(ints), pack_floats(floats), pack_mask(mask))
    native = packing._NATIVE
    packing._NATIVE = False
    try:
        assert (pack_ints(ints), pack_floats(floats), pack_mask(np.array(mask))) == fast
    finally:
        packing._NATIVE = native
