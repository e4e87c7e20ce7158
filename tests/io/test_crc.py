"""``deepoffload.io.crc.crc32``: exactly ``zlib.crc32`` for every buffer kind and size, whichever library runs it."""

from __future__ import annotations

import ctypes
import random
import zlib

import pytest
import torch

from deepoffload.io import crc

SIZES = [0, 1, crc.LIBDEFLATE_MIN_BYTES - 1, crc.LIBDEFLATE_MIN_BYTES, 100_003, 1 << 20, 3_000_001]


@pytest.mark.parametrize("nbytes", SIZES)
def test_crc32_equals_zlibs_for_every_buffer_kind(nbytes):
    rng = random.Random(nbytes)
    data = bytearray(rng.randbytes(nbytes))
    start = rng.getrandbits(32)
    expected = zlib.crc32(data, start)
    as_ctypes = (ctypes.c_char * nbytes).from_buffer(data)
    assert crc.crc32(as_ctypes, start) == expected
    assert crc.crc32(memoryview(data), start) == expected
    assert crc.crc32(bytes(data), start) == expected  # read-only: zlib
    assert crc.crc32(data) == zlib.crc32(data)
    if nbytes > 3:
        assert crc.crc32(memoryview(data)[3:], start) == zlib.crc32(data[3:], start)  # unaligned start


def test_crc32_continues_across_pieces_as_zlib_does():
    tensor = torch.randn(1 << 20)
    whole = (ctypes.c_char * (4 << 20)).from_address(tensor.data_ptr())
    value = 0
    for start in range(0, 4 << 20, 1 << 20):
        value = crc.crc32((ctypes.c_char * (1 << 20)).from_address(tensor.data_ptr() + start), value)
    assert value == zlib.crc32(whole)


def test_large_crcs_use_libdeflate_where_the_system_has_it():
    if ctypes.util.find_library("deflate") is None:
        pytest.skip("libdeflate is not installed here: zlib computes the CRCs")
    assert crc.backend() == "libdeflate"
