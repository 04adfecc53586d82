"""The decoding kernel's host-side choices: the page-size division by multiply is exact, and the split
and tile choices keep their bounds (the struct sizes: tests/test_score_mod_args.py). No GPU."""

import numpy as np
import pytest

from cuflash import dispatch
from cuflash.config import KERNEL_HEADDIMS
from cuflash.decode_launch import division_magic


@pytest.mark.parametrize("divisor", [16, 32, 48, 64, 80, 112, 256, 4096, 12345 * 16])
def test_division_magic_is_exact(divisor):
    mul, shift = division_magic(divisor)
    assert 0 < mul < 2**32
    rng = np.random.default_rng(divisor)
    for n in [0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 1, *rng.integers(0, 2**31, 5000).tolist()]:
        assert ((n * mul >> 32) + n) >> shift == n // divisor


def test_decode_splits_bounds():
    assert dispatch.decode_splits(300, 1000, 264) == 1  # the grid fills the GPU already
    assert dispatch.decode_splits(8, 5, 264) == 1  # too few key blocks to share
    for ctas, blocks in [(1, 2048), (8, 128), (32, 128), (8, 16)]:
        splits = dispatch.decode_splits(ctas, blocks, 264)
        assert 1 <= splits <= dispatch.DECODE_MAX_SPLITS
        assert splits == 1 or blocks // splits >= dispatch.MIN_BLOCKS_PER_SPLIT


@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 128])
def test_decode_config_fits(headdim, rows):
    cfg = dispatch.decode_config(headdim, rows, 227 * 1024)
    assert cfg.smem_bytes() <= 227 * 1024 and cfg.stages >= 2
    assert cfg.warps_m <= (2 if headdim > dispatch.MAX_HEADDIM_4_ROW_WARPS else 4)
