"""The decoding kernel's host-side choices: the page-size division by multiply is exact, the split
and tile choices keep their bounds, and the cache strides the kernel takes as 32-bit are checked (the
struct sizes: tests/test_score_mod_args.py). No GPU."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import decode_launch, dispatch, kv_cache, score_mods
from cuflash.config import DECODE_COPY_WARPS, KERNEL_HEADDIMS, DecodeConfig
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


def test_decode_split_free():
    """Steps over a 16-bit cache run unsplit from SPLIT_FREE_SM_SHARE of the SMs up (over a paged cache
    the 16-row tile up to SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS key blocks); e4m3 caches keep decode_splits'
    choice."""
    sixteen = dispatch.decode_config(128, 4, 227 * 1024, arch=90)
    thirty_two = dispatch.decode_config(128, 32, 227 * 1024, arch=90)
    wgmma = dispatch.decode_config(128, 256, 227 * 1024, arch=90)
    fp8 = dispatch.decode_config(128, 32, 227 * 1024, fp8=True, arch=90)
    assert wgmma.wgmma and fp8.fp8
    least = math.ceil(dispatch.SPLIT_FREE_SM_SHARE * 132)
    longest = dispatch.SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS
    for cfg in (sixteen, thirty_two):
        assert dispatch.decode_split_free(cfg, least, 132, 512, False)
        assert not dispatch.decode_split_free(cfg, least - 1, 132, 16, False)
        assert dispatch.decode_split_free(cfg, least, 132, longest, True)
    assert not dispatch.decode_split_free(sixteen, least, 132, longest + 1, True)
    assert dispatch.decode_split_free(thirty_two, least, 132, longest + 1, True)
    assert dispatch.decode_split_free(wgmma, least, 132, 4 * longest, True)
    assert not dispatch.decode_split_free(wgmma, least - 1, 132, 64, False)
    assert not dispatch.decode_split_free(fp8, 100, 132, 64, False)


def test_decode_split_count():
    """Unsplit where decode_split_free; the wgmma tiles below it as many splits as fit one wave (at least
    MIN_BLOCKS_PER_SPLIT key blocks each), the fewest of the same longest split; the other tiles
    decode_splits' wave rule."""
    wgmma = dispatch.decode_config(128, 128, 227 * 1024, arch=90)
    sixteen = dispatch.decode_config(128, 4, 227 * 1024, arch=90)
    assert wgmma.wgmma
    assert dispatch.decode_split_count(wgmma, 100, 256, 132, 132, False) == 1
    assert dispatch.decode_split_count(wgmma, 60, 256, 132, 132, False) == 2
    assert dispatch.decode_split_count(wgmma, 4, 1024, 132, 132, False) == 32  # 33 fit, none shorter
    assert dispatch.decode_split_count(wgmma, 36, 64, 132, 132, False) == 3
    assert dispatch.decode_split_count(wgmma, 4, 40, 132, 132, False) == 40 // dispatch.MIN_BLOCKS_PER_SPLIT
    assert dispatch.decode_split_count(wgmma, 4, 7, 132, 132, False) == 1
    assert dispatch.decode_split_count(sixteen, 40, 256, 132, 132, False) == dispatch.decode_splits(40, 256, 132)


def test_decode_cluster_plan():
    """Hopper's mma.sync tiles merge in clusters the GPU holds at once, one CTA an SM: one cluster a row
    block of as many splits as the largest cluster, the SMs and MIN_BLOCKS_PER_CLUSTER_SPLIT allow, with
    splits no longer than one_cluster_split_blocks allows on the grid (the 16-row tile's longer than the
    32-row tile's); else several clusters a row block (of 8 CTAs over two thirds of the SMs for the
    16-row tile and a lone row block over a contiguous cache, the largest otherwise; up to
    SEVERAL_CLUSTERS_MAX_BLOCKS blocks a split); else none (0, 0)."""
    gqa = dispatch.decode_config(128, 4, 227 * 1024, arch=90)
    wgmma = dispatch.decode_config(128, 64, 227 * 1024, arch=90)
    h100 = {2: 132, 4: 62, 8: 30, 16: 14}  # the 16-row tile's clusters an H100 holds (cuOccupancyMaxActiveClusters)
    small = {2: 66, 4: 30, 8: 15, 16: 7}  # the 32-row tile's

    def plan(ctas, key_blocks, held=h100, cfg=gqa, arch=90, forced=0, paged=False):
        return dispatch.decode_cluster_plan(cfg, ctas, key_blocks, 132, arch, held, forced, paged)

    assert plan(8, 16) == (8, 8)  # batch 1, 1k keys: splits of MIN_BLOCKS_PER_CLUSTER_SPLIT blocks
    assert plan(8, 32, {**h100, 16: 7}) == (8, 8)  # 2k keys where the GPU holds 7 clusters of 16
    assert plan(8, 128) == (16, 16)  # 8k keys: 128 CTAs of 8 blocks
    assert plan(8, 256) == (16, 16) and plan(8, 257) == (0, 0)  # 128 CTAs: 16 blocks, then the global merge
    assert plan(2, 128) == (16, 16)  # 32 CTAs of 8 blocks
    assert plan(2, 256) == (40, 8)  # 16 blocks on 32 CTAs: 5 clusters of 8 a row block (88 SMs), 7 blocks a split
    assert plan(4, 512) == (16, 16)  # 64 CTAs take 32 blocks a split
    assert plan(64, 16) == (2, 2)  # the SMs hold two splits of 64 row blocks
    assert plan(100, 16) == (0, 0)
    assert plan(8, 3) == (0, 0)  # one split of 2 blocks at most
    mqa = dispatch.decode_config(128, 32, 227 * 1024, arch=90)  # the 32-row tile
    assert plan(1, 16, small, cfg=mqa) == (16, 16)  # MQA batch 1, 1k keys: splits of one block
    assert plan(8, 16, small, cfg=mqa) == (8, 8)  # the GPU holds 15 clusters of 8, 7 of 16
    assert plan(1, 64, small, cfg=mqa) == (16, 16)  # 4k keys: one cluster of 4 blocks a split
    # One row block over 8k keys: 16 CTAs of 8 blocks would idle the SMs; clusters of 8 of 2 blocks a split.
    assert plan(1, 128, small, cfg=mqa) == (64, 8)
    assert plan(1, 256, small, cfg=mqa) == (88, 8)  # 11 clusters of 8 over two thirds of the SMs
    assert plan(1, 2048, small, cfg=mqa) == (88, 8)  # 128k keys: 24 blocks a split
    many = 120 * dispatch.SEVERAL_CLUSTERS_MAX_BLOCKS  # past 11 clusters' splits: up to the 15 the GPU holds
    assert plan(1, many, small, cfg=mqa) == (120, 8) and plan(1, many + 1, small, cfg=mqa) == (0, 0)
    assert plan(2, 128, small, cfg=mqa) == (48, 16)  # two row blocks keep clusters of 16
    assert plan(1, 256, small, cfg=mqa, paged=True) == (112, 16)  # paged: the largest clusters over every SM
    assert plan(2, 256, paged=True) == (64, 16)
    assert plan(4, 128, paged=True) == (16, 16)  # 8 blocks on 64 CTAs
    assert plan(4, 256, paged=True) == (32, 16)  # 16: two clusters
    assert plan(4, 128, small, cfg=mqa) == (16, 16)  # 64 CTAs of 8 blocks
    assert plan(8, 128, small, cfg=mqa) == (0, 0)  # 8 row blocks: one cluster of 8 each holds 16 blocks a split
    assert plan(8, 16, forced=16) == (16, 16) and plan(8, 16, forced=17) == (0, 0)
    assert plan(8, 16, {**h100, 16: 7}, forced=16) == (0, 0)  # the GPU holds 7 clusters of 16, not 8
    assert plan(67, 16, forced=2) == (0, 0)  # 134 CTAs: more than the SMs
    assert plan(8, 16, {}) == (0, 0)  # the GPU holds no clusters
    assert plan(8, 16, arch=80) == (0, 0) and plan(8, 16, cfg=wgmma) == (0, 0)


@pytest.mark.parametrize("num_splits,cluster,partials,in_kernel", [(1, 0, 0, False), (4, 4, 0, False),
                                                                    (4, 0, 4, True), (32, 16, 2, False),
                                                                    (32, 0, 32, True), (33, 0, 33, False)])
def test_decode_launch_partials(monkeypatch, num_splits, cluster, partials, in_kernel):
    """A launch asks for a partials workspace only where results merge through global memory: each
    split's, or each cluster's where a row block has several (the combine kernel merges those); none
    with one split or one cluster a row block (a capture must not grow a workspace it never reads).
    The kernel merges up to DECODE_MERGE_MAX_SPLITS splits itself, the combine kernel more."""
    for name in ("kernel", "LaunchInClusters", "CombineLaunch"):  # no driver here
        monkeypatch.setattr(decode_launch, name, lambda *args, **kwargs: SimpleNamespace(smem_bytes=0))
    monkeypatch.setattr(decode_launch, "compute_capability", lambda device_id: 90)
    cfg = dispatch.decode_config(128, 4, 227 * 1024, arch=90)
    batch, nq, nheads, headdim = 2, 1, 8, 128
    cache = SimpleNamespace(shape=(batch, 512, 2, headdim))
    strides = {name: (512 * 2 * headdim, 2 * headdim, headdim) for name in ("q", "kc", "vc", "o")}
    launch = decode_launch.DecodeLaunch(cfg, "float16", False, False, score_mods.NONE, (batch, nq, nheads, headdim),
                                        cache, 0, strides, None, None, num_splits, 0.1, 0, cluster=cluster)
    assert launch.partial_floats == partials * batch * nq * nheads * (headdim + 1)
    assert launch.merge_in_kernel == in_kernel
    assert (launch.combine is not None) == (partials > 0 and not in_kernel)


@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 128])
@pytest.mark.parametrize("max_smem", [227 * 1024, 163 * 1024, 99 * 1024])
def test_decode_config_fits(headdim, rows, max_smem):
    if max_smem == 99 * 1024 and headdim > 160:
        pytest.skip("64 keys a stage of head dim > 160 need more than 99 KB")
    cfg = dispatch.decode_config(headdim, rows, max_smem)
    assert cfg.is_valid() and cfg.smem_bytes() <= max_smem and cfg.stages >= 2
    assert cfg.warps_m <= (2 if headdim > dispatch.MAX_HEADDIM_4_ROW_WARPS else 4)
    assert cfg.block_m >= min(rows, 16 * cfg.warps_m)


def test_decode_config_tiles():
    """16 rows or fewer: one row warp by 4 key warps; 17-32 rows: 2 by 4 where the warps' merge fits
    the ring (else 2 by 2); more: 4 by 1."""
    assert (dispatch.decode_config(128, 8, 227 * 1024).warps_m, dispatch.decode_config(128, 8, 227 * 1024).warps_n) \
        == (1, 4)
    wide = dispatch.decode_config(128, 32, 227 * 1024)
    assert (wide.warps_m, wide.warps_n, wide.threads) == (2, 4, 256)
    assert dispatch.decode_config(256, 32, 227 * 1024).warps_n == 2
    assert dispatch.decode_config(128, 32, 99 * 1024).warps_n == 2  # 2 stages: the 8 warps' merge does not fit
    tall = dispatch.decode_config(64, 128, 227 * 1024)
    assert (tall.warps_m, tall.warps_n) == (4, 1)


@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("rows", [1, 32, 33, 64, 65, 128, 1000])
def test_decode_config_wgmma_tiles(headdim, rows):
    """On sm_90, more than 32 rows over a 16-bit cache at head dims 64 and 128 take the wgmma tiles:
    one warpgroup up to 64 rows, two past it, one key warp, a ring of at least 3 stages; other
    head dims, fewer rows, an fp8 cache and other GPUs keep the mma.sync tiles."""
    cfg = dispatch.decode_config(headdim, rows, 227 * 1024, arch=90)
    expected = rows > 32 and headdim in (64, 128)
    assert cfg.wgmma == expected and cfg.is_valid() and cfg.smem_bytes() <= 227 * 1024
    if expected:
        assert (cfg.warps_m, cfg.warps_n, cfg.family) == (8 if rows > 64 else 4, 1, "decode_sm90")
        assert cfg.stages >= 3 and "_wgmma" in cfg.short_name()
        assert cfg.name_expression("float16", False, True).endswith(", true>")
    assert not dispatch.decode_config(headdim, rows, 227 * 1024, arch=80).wgmma
    assert not dispatch.decode_config(headdim, rows, 227 * 1024, fp8=True, arch=90).wgmma
    assert not dispatch.decode_config(headdim, rows, 227 * 1024, arch=100).wgmma


def test_decode_config_wgmma_rules():
    """The kernel's static constraints on wgmma tiles, as is_valid states them."""
    assert not DecodeConfig(128, 2, 4, 4, wgmma=True).is_valid()  # key warps
    assert not DecodeConfig(96, 4, 1, 4, wgmma=True).is_valid()  # swizzled 64-column panels
    assert not DecodeConfig(128, 4, 1, 2, wgmma=True).is_valid()  # a block in flight beside two in use
    assert not DecodeConfig(128, 4, 1, 4, fp8=True, wgmma=True).is_valid()
    assert DecodeConfig(128, 8, 1, 4, wgmma=True).is_valid()


def test_decode_wgmma_tiles_copy_warps_and_barriers():
    """wgmma tiles launch a warpgroup of copy warps after the row warps, and end their shared memory with
    each stage's full and empty mbarriers and the merge's two, past the ring the merge reuses; the
    mma.sync tiles keep neither."""
    for warps_m, stages in ((4, 4), (8, 4), (8, 8)):
        cfg = DecodeConfig(128 if stages == 4 else 64, warps_m, 1, stages, wgmma=True)
        layout = cfg.smem_layout()
        assert cfg.threads == 32 * (warps_m + DECODE_COPY_WARPS) and DECODE_COPY_WARPS == 4
        assert layout["SMEM_BYTES"] - layout["OFF_BARS"] == 16 * stages + 16
        assert layout["OFF_BARS"] % 8 == 0
        plain = DecodeConfig(cfg.headdim, warps_m, 1, stages)
        assert plain.threads == 32 * warps_m
        assert plain.smem_bytes() == layout["OFF_BARS"] == plain.smem_layout()["OFF_BARS"]


def test_decode_slots_count_warps():
    """A GPU is full at DECODE_WARPS_PER_SM warps an SM (DECODE_WARPS_PER_SM_16BIT for the mma.sync tiles
    over a 16-bit cache), one CTA at least, or what shared memory lets reside."""
    four = dispatch.decode_config(128, 8, 227 * 1024)
    eight = dispatch.decode_config(128, 32, 227 * 1024)
    fp8 = dispatch.decode_config(128, 8, 227 * 1024, fp8=True)
    per_sm, per_sm_16 = dispatch.DECODE_WARPS_PER_SM, dispatch.DECODE_WARPS_PER_SM_16BIT
    assert dispatch.decode_slots(four, 2, 132) == 132 * max(1, min(2, per_sm_16 // 4))
    assert dispatch.decode_slots(eight, 2, 132) == 132 * max(1, per_sm_16 // 8)
    assert dispatch.decode_slots(fp8, 3, 132) == 132 * max(1, min(3, per_sm // (fp8.warps_m * fp8.warps_n)))
    assert dispatch.decode_slots(four, 1, 132) == 132


def test_decode_config_fp8_cache():
    """An e4m3 cache: a smaller ring (three CTAs an SM at head dim 128) and 4-warp tiles."""
    fp8 = dispatch.decode_config(128, 1, 227 * 1024, fp8=True)
    assert fp8.fp8 and fp8.is_valid() and 3 * fp8.smem_bytes() <= 227 * 1024
    assert dispatch.decode_config(128, 32, 227 * 1024, fp8=True).warps_n == 2
    assert "_e4m3" in fp8.short_name() and ", true, " in fp8.name_expression("float16", False, False)


@pytest.mark.parametrize("paged, shape, strides, what", [
    (False, (2, 16, 2, 64), (4096, -256, 128, 2), "position"),  # positions reversed
    (False, (2, 2**16, 2**9, 64), (2**34, 2**16, 128, 2), None),  # batch rows past 2^32 bytes: 64-bit in the kernel
    (False, (2, 2, 1, 64), (2**34, 2**32, 128, 2), "position"),
    (True, (3, 16, 2, 64), (2**32, 256, 128, 2), "page"),
    (True, (1, 16, 2, 64), (2**32, 256, 128, 2), None),  # one page: its stride is never used
    (True, (3, 16, 2, 64), (4096, 256, 128, 2), None),
])
def test_cache_row_strides(paged, shape, strides, what):
    """Position (and page) strides must lie in [0, 2^32) bytes where the dim has more than one entry."""
    cache = SimpleNamespace(shape=shape, strides=strides)
    if what is None:
        kv_cache._check_row_strides("k_cache", cache, paged)
    else:
        with pytest.raises(ValueError, match=f"k_cache: its {what} stride"):
            kv_cache._check_row_strides("k_cache", cache, paged)


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("rows", [33, 64, 100, 128, 256, 512])
def test_decode_config_small_steps(headdim, rows):
    """On sm_90, a step of few 32-row x 64-key units per SM (decode_small_step: more at head dim 128 with
    64 rows or fewer) takes the 32-row mma.sync tile for its rows instead of the wgmma tiles; large
    steps, other GPUs, fp8 caches and large_step_tiles() keep the tiles of before."""
    wide = headdim == 128 and rows <= 64
    limit = dispatch.WIDE_SMALL_STEP_UNITS_PER_SM if wide else dispatch.SMALL_STEP_UNITS_PER_SM
    row_blocks = -(-rows // 32)
    small, large = 0.99 * limit / row_blocks, 1.01 * limit / row_blocks  # kv blocks per SM
    assert dispatch.decode_small_step(headdim, rows, small) and not dispatch.decode_small_step(headdim, rows, large)
    thirty_two = dispatch.decode_config(headdim, 32, 227 * 1024, arch=90)
    assert dispatch.decode_config(headdim, rows, 227 * 1024, arch=90, kv_blocks_per_sm=small) == thirty_two
    assert dispatch.decode_config(headdim, rows, 227 * 1024, arch=90, kv_blocks_per_sm=large).wgmma
    assert dispatch.decode_config(headdim, rows, 227 * 1024, arch=90) == \
        dispatch.decode_config(headdim, rows, 227 * 1024, arch=90, kv_blocks_per_sm=large)
    assert dispatch.decode_config(headdim, rows, 227 * 1024, arch=80, kv_blocks_per_sm=small) == \
        dispatch.decode_config(headdim, rows, 227 * 1024, arch=80)
    assert dispatch.decode_config(headdim, rows, 227 * 1024, True, 90, small) == \
        dispatch.decode_config(headdim, rows, 227 * 1024, True, 90)
    with dispatch.large_step_tiles():
        assert dispatch.decode_config(headdim, rows, 227 * 1024, arch=90, kv_blocks_per_sm=small).wgmma
        assert not dispatch.small_step_tiles()
    assert dispatch.small_step_tiles()


def test_decode_halves_rows():
    """Only a short cache's step (HALVED_ROWS_MAX_KEY_BLOCKS) whose 32-row mma.sync tile splits its keys
    in two may take two row blocks of the 16-row tile instead, on Hopper."""
    smem = 227 * 1024
    mqa = dispatch.decode_config(128, 32, smem, arch=90)
    assert (mqa.block_m, mqa.wgmma) == (32, False)
    blocks = dispatch.HALVED_ROWS_MAX_KEY_BLOCKS
    assert dispatch.decode_halves_rows(mqa, 32, blocks, 2, 90)
    assert dispatch.decode_halves_rows(mqa, 24, blocks, 2, 90)  # 17-32 rows
    assert not dispatch.decode_halves_rows(mqa, 32, blocks + 1, 2, 90)  # a longer cache
    assert not dispatch.decode_halves_rows(mqa, 32, blocks, 1, 90)  # no split to save
    assert not dispatch.decode_halves_rows(mqa, 32, blocks, 8, 90)  # 8-way clusters: no gain measured
    assert not dispatch.decode_halves_rows(dispatch.decode_config(128, 32, smem, arch=80), 32, blocks, 2, 80)
    gqa = dispatch.decode_config(128, 16, smem, arch=90)
    assert gqa.block_m == 16 and not dispatch.decode_halves_rows(gqa, 16, blocks, 2, 90)
    e4m3 = dispatch.decode_config(128, 32, smem, fp8=True, arch=90)
    assert not dispatch.decode_halves_rows(e4m3, 32, blocks, 2, 90)
