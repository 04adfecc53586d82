"""Tensor-map arguments for the Hopper kernel (no GPU: the encoding itself needs the driver)."""

import types

import pytest

from cuflash import tma


def fake_array(shape, strides, ptr=0x10000, itemsize=2):
    return types.SimpleNamespace(shape=shape, strides=strides, itemsize=itemsize, data=types.SimpleNamespace(ptr=ptr))


def test_extent_one_dims_get_packed_strides():
    # (seq 1, heads 1, batch 3): the two unit dims' strides (here 0) become
    # the packed extents inside them, rounded up to 16 bytes.
    assert tma._safe_strides(72 * 2, (1, 1, 3), (0, 0, 4096)) == (144, 144, 4096)
    assert tma._safe_strides(64 * 2, (5, 1, 1), (256, 7, 0)) == (256, 1280, 1280)


def test_strides_of_real_dims_are_kept():
    assert tma._safe_strides(128 * 2, (4096, 16, 2), (16 * 256, 256, 4096 * 16 * 256)) == (
        4096, 256, 4096 * 16 * 256)


@pytest.mark.parametrize("strides, ptr, ok", [
    ((4096 * 256, 256 * 16, 256, 2), 0x10000, True),   # contiguous (B, N, H, D)
    ((4096 * 256, 256 * 16, 256 + 8, 2), 0x10000, False),  # head stride not a multiple of 16 bytes
    ((4096 * 256, 256 * 16, 256, 2), 0x10008, False),  # pointer not 16-byte aligned
    ((0, 256 * 16, 256, 2), 0x10000, False),           # broadcast batch
    ((4096 * 256, -256 * 16, 256, 2), 0x10000, False),  # reversed sequence
])
def test_usable(strides, ptr, ok):
    assert tma.usable(fake_array((2, 4096, 16, 128), strides, ptr)) is ok


def test_unit_dims_do_not_count_against_usable():
    assert tma.usable(fake_array((1, 4096, 1, 128), (0, 256, 0, 2)))
