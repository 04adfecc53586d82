"""Attention over a KV cache: cuflash.attention_with_kvcache against cuflash.reference's float64
function with the 2x rule, the cache after the call against the reference append, and
cuflash.combine_partials against whole attention.

Cases draw random cache lengths (0 included), shuffled page tables, GQA
ratios 1 to 32, 1 to 16 queries, both rotary modes; outputs start poisoned,
and cache positions the call must not write hold poison that has to survive.
"""

import contextlib

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import dispatch, kv_cache, reference, score_mods
from cuflash.config import DecodeConfig
from cuflash.decode_launch import clusters_held
from cuflash.device import compute_capability, max_smem_per_block, sm_count
from tests.numerics import (ATOL, DTYPES, FUZZ_CASES, FUZZ_SEED, assert_close_2x, check_lse, fuzz_indices, mentions,
                           paged_prefill_case, randn)

pytestmark = pytest.mark.gpu

POISON = 1e4


def _ulp_distance(a, b):
    """Largest distance in units of the last place between two 16-bit arrays of one dtype."""
    ai = a.view(np.int16).astype(np.int32)
    bi = b.view(np.int16).astype(np.int32)
    return int(np.abs(ai - bi).max(initial=0))


def _e4m3_code_distance(a, b):
    """Largest distance between two arrays of e4m3 codes (uint8) of equal signs: codes of one sign
    are ordered by magnitude."""
    assert np.array_equal(a & 0x80, b & 0x80) or np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 1
    return int(np.abs((a & 0x7F).astype(np.int32) - (b & 0x7F).astype(np.int32)).max(initial=0))


def run_case(rng, *, dtype=np.float16, batch=3, seqlen_q=1, nheads=8, nheads_kv=2, headdim=128, capacity=300,
             n_new=1, page_size=None, rotary=None, leftpad=False, batch_idx=False, lengths="random",
             num_splits=0, host_lengths=False, fp8=False, misaligned_tables=False, **options):
    group_rows = batch + 2 if batch_idx else batch
    q = randn(rng, (batch, seqlen_q, nheads, headdim), dtype)
    if page_size is None:
        cache_shape = (group_rows, capacity, nheads_kv, headdim)
        block_table = None
    else:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 3
        cache_shape = (num_pages, page_size, nheads_kv, headdim)
        block_table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
        block_table = block_table.astype(np.int32)
        capacity = pages_per_seq * page_size
    if fp8:  # e4m3 codes of values up to ~ +-16, a descale per (batch, kv head) of magnitude ~ 0.1
        rows = (cache_shape[0] * cache_shape[1], *cache_shape[2:])
        k_cache, v_cache = (reference.kvcache_quantize(4 * randn(rng, rows, np.float32), np.ones(nheads_kv))
                            .reshape(cache_shape) for _ in range(2))
        options["k_descale"], options["v_descale"] = (rng.uniform(0.02, 0.3, (batch, nheads_kv)).astype(np.float32)
                                                      for _ in range(2))
    else:
        k_cache = randn(rng, cache_shape, dtype)
        v_cache = randn(rng, cache_shape, dtype)
    k_new = randn(rng, (batch, n_new, nheads_kv, headdim), dtype) if n_new else None
    v_new = randn(rng, (batch, n_new, nheads_kv, headdim), dtype) if n_new else None
    if lengths == "random":
        seqlens = rng.integers(0, capacity - n_new + 1, batch).astype(np.int32)
        seqlens[0] = 0  # an empty cache plus the new keys
        seqlens[-1] = capacity - n_new  # a full one
    else:
        seqlens = np.full(batch, lengths, np.int32)
    pad = np.array([rng.integers(0, max(s, 1)) if s else 0 for s in seqlens], np.int32) if leftpad else None
    idx = rng.permutation(group_rows)[:batch].astype(np.int32) if batch_idx else None
    cos = sin = None
    if rotary is not None:
        rotary_dim = headdim if rotary == "full" else headdim // 2
        angles = rng.uniform(0, 2 * np.pi, (capacity + seqlen_q, rotary_dim // 2))
        cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    slopes = None
    if options.pop("alibi", False):
        slopes = rng.uniform(0.01, 0.3, (batch, nheads)).astype(np.float32)
    interleaved = options.pop("interleaved", True)

    host = dict(cache_seqlens=seqlens, cache_batch_idx=idx, cache_leftpad=pad, block_table=block_table,
                rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, alibi_slopes=slopes, **options)
    ref, ref_lse, k_after, v_after = reference.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **host)
    naive, _, _, _ = reference.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, lowp_dtype=dtype, **host)

    dev = {name: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for name, x in host.items()}
    if host_lengths:
        dev["cache_seqlens"] = seqlens
    if misaligned_tables:  # contiguous, one element past a 16-byte boundary
        for name in ("rotary_cos", "rotary_sin"):
            flat = cupy.empty(host[name].size + 1, dtype)
            dev[name] = flat[1:].reshape(host[name].shape)
            dev[name][...] = cupy.asarray(host[name])
    kc, vc = cupy.asarray(k_cache), cupy.asarray(v_cache)
    out = cupy.full(q.shape, POISON, dtype)
    result, lse = cuflash.attention_with_kvcache(
        cupy.asarray(q), kc, vc, None if k_new is None else cupy.asarray(k_new),
        None if v_new is None else cupy.asarray(v_new), out=out, return_lse=True, num_splits=num_splits, **dev)
    assert result is out
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(dtype)])
    check_lse(lse, ref_lse)
    if fp8:
        if rotary is None:
            np.testing.assert_array_equal(kc.get(), k_after)
        else:  # one rounding apart in q's dtype (below) can move the e4m3 code by one
            assert _e4m3_code_distance(kc.get(), k_after) <= 1
        np.testing.assert_array_equal(vc.get(), v_after)
        return
    if rotary is None:
        np.testing.assert_array_equal(kc.get().view(np.int16), k_after.view(np.int16))
    else:  # rotated in fp32 by the kernel, in float64 by the reference: at most one rounding apart
        assert _ulp_distance(kc.get(), k_after) <= 1
    np.testing.assert_array_equal(vc.get().view(np.int16), v_after.view(np.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_decode_gqa(dtype, group):
    rng = np.random.default_rng(group)
    run_case(rng, dtype=dtype, nheads=2 * group if group < 32 else 32, nheads_kv=2 if group < 32 else 1,
             capacity=1025)


@pytest.mark.parametrize("headdim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [4, 16])  # 8 and 32 packed rows: the 4- and (head dim <= 128) 8-warp tiles
def test_head_dims(headdim, group):
    run_case(np.random.default_rng(headdim + group), headdim=headdim, capacity=257, n_new=2, seqlen_q=2,
             causal=True, nheads=2 * group, nheads_kv=2)


@pytest.mark.parametrize("seqlen_q", [1, 2, 8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_speculative_causal(seqlen_q, group):
    run_case(np.random.default_rng(seqlen_q * 100 + group), seqlen_q=seqlen_q, n_new=seqlen_q, nheads=2 * group,
             nheads_kv=2, capacity=97 * 3, causal=True)


# 64 packed rows per kv head take the 4-row-warp tile, whose contiguous copies go by row runs where
# a head dim's chunks fit them (32, 64, 128) and by whole rows elsewhere (96, 160): with leftpad,
# new keys, an empty and a full cache, lengths ending inside a run.
@pytest.mark.parametrize("headdim,fp8", [(32, False), (64, False), (96, False), (128, False), (160, False),
                                         (64, True), (128, True)])
def test_row_tile_64_head_dims(headdim, fp8):
    run_case(np.random.default_rng(headdim + fp8), headdim=headdim, fp8=fp8, seqlen_q=8, nheads=16, nheads_kv=2,
             capacity=333, n_new=2, causal=True, leftpad=True)


# On sm_90 more than 32 packed rows per kv head over a 16-bit cache at head dims 64 and 128 take the
# wgmma tiles (one warpgroup up to 64 rows, two past it) in steps too large for the 32-row tile
# (dispatch.decode_small_step; these small ones are held to the wgmma tiles): row counts that fill
# neither a warpgroup nor a tile, with leftpad, new keys, rotary, paging, forced splits and every
# score option.
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("case", [
    dict(seqlen_q=3, nheads=32, nheads_kv=2, causal=True),  # 48 rows: one warpgroup
    dict(seqlen_q=8, nheads=32, nheads_kv=1, causal=True, leftpad=True),  # 256 rows: two tiles of 128
    dict(seqlen_q=5, nheads=40, nheads_kv=2, dtype=DTYPES[1], page_size=16),  # 100 rows, bf16, paged
    dict(seqlen_q=4, nheads=32, nheads_kv=1, causal=True, rotary="half", num_splits=3),
    dict(seqlen_q=6, nheads=16, nheads_kv=1, causal=True, window_size=(50, -1), softcap=4.0, alibi=True),
], ids=["48rows", "256rows_leftpad", "100rows_bf16_paged", "128rows_rotary_splits", "96rows_options"])
def test_wgmma_tiles(headdim, case):
    rows = case["seqlen_q"] * case["nheads"] // case["nheads_kv"]
    device_id = cupy.cuda.Device().id
    cfg = dispatch.decode_config(headdim, rows, max_smem_per_block(device_id), arch=compute_capability(device_id))
    assert cfg.wgmma == (compute_capability(device_id) == 90)
    with dispatch.large_step_tiles():
        run_case(np.random.default_rng(headdim + rows), headdim=headdim, capacity=333, n_new=2, **case)


# Small steps with more than 32 packed rows a kv head take the 32-row tile on sm_90, their rows as row
# blocks of 32 (dispatch.decode_small_step): MQA with 8 queries (8 row blocks), GQA groups of 16 with
# 3 (48 rows: a partial second block), with new keys, rotary, leftpad, paging, bf16, splits and options.
@pytest.mark.parametrize("case", [
    dict(seqlen_q=8, nheads=32, nheads_kv=1, causal=True, rotary="half", n_new=8),
    dict(seqlen_q=3, nheads=32, nheads_kv=2, causal=True, leftpad=True, n_new=2),
    dict(seqlen_q=5, nheads=32, nheads_kv=1, dtype=DTYPES[1], page_size=16, rotary="full", n_new=5),
    dict(seqlen_q=4, nheads=32, nheads_kv=1, causal=True, num_splits=3, window_size=(70, -1), softcap=4.0,
         alibi=True),
], ids=["mqa_nq8_rotary", "gqa16_48rows_leftpad", "mqa_bf16_paged", "mqa_splits_options"])
def test_small_steps_row_tile_32(case):
    device_id = cupy.cuda.Device().id
    if compute_capability(device_id) != 90:
        pytest.skip("the 32-row tile replaces the wgmma tiles in small steps on sm_90")
    batch, capacity = 3, 333
    rows = case["seqlen_q"] * case["nheads"] // case["nheads_kv"]
    key_blocks = -(-capacity // DecodeConfig.BLOCK_N)
    cfg = dispatch.decode_config(128, rows, max_smem_per_block(device_id), arch=90,
                                 kv_blocks_per_sm=batch * case["nheads_kv"] * key_blocks / sm_count(device_id))
    assert (cfg.block_m, cfg.wgmma) == (32, False)
    run_case(np.random.default_rng(rows), batch=batch, capacity=capacity, **case)


# The tiles where a thread rotates several Q chunks at once (the wgmma tiles, the 64-row tile over an
# e4m3 cache): both rotary modes over the whole and half the head dim, and tables not 16-byte aligned.
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("rotary", ["full", "half"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_wgmma_tiles_rotary(headdim, rotary, interleaved):
    with dispatch.large_step_tiles():
        run_case(np.random.default_rng(headdim + len(rotary) + interleaved), headdim=headdim, rotary=rotary,
                 interleaved=interleaved, seqlen_q=5, n_new=5, nheads=32, nheads_kv=1, causal=True, capacity=200,
                 misaligned_tables=rotary == "full")


# Without causal or a window, every query row of a step takes its rotary angles at cache_seqlens
# (flash-attn's convention), on each tile that rotates Q: 16-row (4 rows a kv head), 32-row (MQA
# at Nq = 2: its Q rotated late), 64-row over an e4m3 cache, the wgmma tiles, and a paged cache.
@pytest.mark.parametrize("case", [
    dict(nheads=8, nheads_kv=2, seqlen_q=4, n_new=4, rotary="half"),
    dict(nheads=16, nheads_kv=1, seqlen_q=2, n_new=1, rotary="full", interleaved=False),
    dict(nheads=16, nheads_kv=2, seqlen_q=8, n_new=3, rotary="half", fp8=True),
    dict(nheads=32, nheads_kv=1, seqlen_q=5, n_new=5, rotary="full", large=True),
    dict(nheads=8, nheads_kv=2, seqlen_q=3, n_new=2, rotary="full", page_size=16, interleaved=False),
], ids=["16rows", "32rows", "64rows_e4m3", "wgmma", "paged"])
def test_rotary_without_causal_one_position(case):
    case = dict(case)
    tiles = dispatch.large_step_tiles() if case.pop("large", False) else contextlib.nullcontext()
    with tiles:
        run_case(np.random.default_rng(len(case) + case["seqlen_q"]), capacity=250, **case)


@pytest.mark.parametrize("interleaved", [True, False])
def test_row_tile_64_fp8_rotary(interleaved):
    run_case(np.random.default_rng(64 + interleaved), fp8=True, rotary="half", interleaved=interleaved, seqlen_q=8,
             n_new=8, nheads=16, nheads_kv=2, causal=True, capacity=333, misaligned_tables=interleaved)


# The 32-row tile over a contiguous cache (17-32 packed rows a kv head) loads rotated Q before the
# ring's first copies and rotates it after them: MQA at Nq = 1, GQA groups of 16 at Nq = 2, both rotary
# modes, 16-bit and e4m3 caches, with new keys and forced splits.
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("case", [
    dict(nheads=32, nheads_kv=1, seqlen_q=1, n_new=1, rotary="full"),
    dict(nheads=32, nheads_kv=1, seqlen_q=1, n_new=1, rotary="half", dtype=DTYPES[1], num_splits=5),
    dict(nheads=32, nheads_kv=2, seqlen_q=2, n_new=2, rotary="full", causal=True),
    dict(nheads=32, nheads_kv=1, seqlen_q=1, n_new=1, rotary="half", fp8=True),
], ids=["mqa", "mqa_bf16_splits", "gqa16_nq2", "mqa_e4m3"])
def test_row_tile_32_rotary(interleaved, case):
    run_case(np.random.default_rng(32 + interleaved + len(case)), interleaved=interleaved, capacity=777, **case)


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_paged(page_size, dtype):
    run_case(np.random.default_rng(page_size), dtype=dtype, page_size=page_size, capacity=700, batch=4, n_new=3,
             seqlen_q=3, causal=True)


# Paged copies go by runs of a 16-row group (decode_sm80.cuh): head dims whose chunks fit them (64,
# 112 with its zero-filled columns, 128, 256) and those that keep one chunk a thread (80), on the 4-
# and 8-warp tiles, with lengths that end inside a run.
@pytest.mark.parametrize("headdim", [64, 80, 112, 128, 256])
@pytest.mark.parametrize("group", [4, 16])
def test_paged_head_dims(headdim, group):
    run_case(np.random.default_rng(headdim * group), page_size=16, capacity=333, batch=3, n_new=2, seqlen_q=2,
             causal=True, headdim=headdim, nheads=2 * group, nheads_kv=2)


@pytest.mark.parametrize("rotary", ["full", "half"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_rotary(rotary, interleaved, paged):
    run_case(np.random.default_rng(7), rotary=rotary, interleaved=interleaved, page_size=32 if paged else None,
             seqlen_q=4, n_new=4, causal=True, capacity=200)


@pytest.mark.parametrize("name, options", [
    ("window", dict(window_size=(40, -1), causal=True)),
    ("window_both", dict(window_size=(30, 5))),
    ("softcap", dict(softcap=5.0)),
    ("alibi", dict(alibi=True)),
    ("all", dict(window_size=(64, -1), causal=True, softcap=3.0, alibi=True)),
])
@pytest.mark.parametrize("group", [4, 8])  # 12 and 24 packed rows: the 4- and 8-warp tiles
def test_score_options(name, options, group):
    run_case(np.random.default_rng(len(name) + group), seqlen_q=3, n_new=3, capacity=400, nheads=2 * group,
             **options)


# The new rows go into the cache before the ring copies them: a CTA appends those of its own key
# blocks, and the first split of the first row block those its row block does not attend. Here a
# window leaves new rows that no query attends, and in the two-tile cases (256 rows a kv head on
# Hopper) the first row block does not attend the last ones; rotated, paged and e4m3 caches.
@pytest.mark.parametrize("case", [
    dict(seqlen_q=1, n_new=40, nheads=8, nheads_kv=2, window_size=(6, -1), causal=True),
    dict(seqlen_q=2, n_new=40, nheads=8, nheads_kv=2, window_size=(6, -1), causal=True, rotary="half",
         interleaved=False, page_size=16),
    dict(seqlen_q=2, n_new=30, nheads=8, nheads_kv=2, window_size=(3, 1), fp8=True, rotary="full"),
    dict(seqlen_q=8, n_new=8, nheads=32, nheads_kv=1, window_size=(2, -1), causal=True, rotary="full",
         num_splits=4),
    dict(seqlen_q=8, n_new=20, nheads=32, nheads_kv=1, window_size=(4, -1), causal=True, page_size=16),
], ids=["unattended", "unattended_paged_rotary", "unattended_e4m3", "two_row_blocks", "two_row_blocks_paged"])
def test_new_rows_outside_the_attended_keys(case):
    run_case(np.random.default_rng(case["n_new"] + case["seqlen_q"]), capacity=300, batch=3, **case)


@pytest.mark.parametrize("headdim", [16, 128, 136])  # 16, 136: the combine's last column pass is partial
@pytest.mark.parametrize("num_splits", [1, 2, 5, 17])
# 8 packed rows per kv head: a 16-row tile, whose last split CTA merges the splits in the kernel;
# 64 rows: a larger tile, merged by the combine kernel.
@pytest.mark.parametrize("nheads,nheads_kv", [(8, 2), (32, 1)], ids=["merge_in_kernel", "combine_kernel"])
def test_forced_splits(num_splits, headdim, nheads, nheads_kv):
    run_case(np.random.default_rng(num_splits), num_splits=num_splits, capacity=1100, batch=2, seqlen_q=2,
             n_new=2, causal=True, headdim=headdim, nheads=nheads, nheads_kv=nheads_kv)


# More splits than the kernel merges itself (DECODE_MERGE_MAX_SPLITS): the 16-row tile's splits go to
# the combine kernel, paged and contiguous.
@pytest.mark.parametrize("page_size", [None, 16])
def test_many_splits_16_row_tile(page_size):
    run_case(np.random.default_rng(40), num_splits=40, capacity=2700, batch=2, seqlen_q=2, n_new=2, causal=True,
             nheads=8, nheads_kv=2, page_size=page_size)


# (nheads, nheads_kv, n_new, fp8, page_size): 16-row tiles (GQA, MHA), the 32-row tile (MQA, merged by
# the combine kernel outside clusters), an e4m3 cache, a paged cache with new keys.
CLUSTER_CASES = {"gqa": (8, 2, 0, False, None), "mha": (4, 4, 1, False, None), "mqa": (32, 1, 0, False, None),
                 "e4m3": (8, 2, 0, True, None), "paged": (8, 2, 2, False, 16)}


@pytest.mark.parametrize("num_splits", [2, 3, 8, 16])
@pytest.mark.parametrize("case", CLUSTER_CASES)
def test_splits_merged_in_clusters(case, num_splits):
    """Hopper: a small step's split CTAs merge inside thread-block clusters; random lengths leave
    some splits without keys (lse -inf: weight 0) and one batch with none at all."""
    nheads, nheads_kv, n_new, fp8, page_size = CLUSTER_CASES[case]
    batch, capacity = 2, 700
    _expect_cluster_plan(nheads // nheads_kv, batch * nheads_kv, capacity, fp8, page_size is not None, n_new > 1,
                         num_splits, (num_splits, num_splits))
    run_case(np.random.default_rng(num_splits), num_splits=num_splits, capacity=capacity, batch=batch,
             nheads=nheads, nheads_kv=nheads_kv, n_new=n_new, fp8=fp8, page_size=page_size, causal=n_new > 1)


# (nheads_kv, seqlen_q, fp8, page_size, batch, capacity): MQA (the 32-row tile; a lone row block takes
# clusters of 8), 32 on 2 (full 16-row tiles, clusters of 8), MQA with two queries over an e4m3 cache
# (64 rows: the 64-row tile), MQA paged.
SEVERAL_CLUSTER_CASES = {"mqa": (1, 1, False, None, 2, 8192), "mqa_lone": (1, 1, False, None, 1, 8192),
                         "gqa16": (2, 1, False, None, 1, 16384), "mqa_e4m3_64rows": (1, 2, True, None, 2, 8192),
                         "mqa_paged": (1, 1, False, 16, 2, 8192)}


@pytest.mark.parametrize("case", SEVERAL_CLUSTER_CASES)
@pytest.mark.parametrize("n_new", [0, 1])
def test_row_blocks_of_several_clusters(case, n_new):
    """Hopper, one kv head or two over 8k-16k keys: each row block's splits are several clusters, whose
    merged results the combine kernel merges."""
    nheads_kv, seqlen_q, fp8, page_size, batch, capacity = SEVERAL_CLUSTER_CASES[case]
    rows = seqlen_q * 32 // nheads_kv
    splits, cluster = _expect_cluster_plan(rows, batch * nheads_kv, capacity, fp8, page_size is not None,
                                           seqlen_q > 1, 0, None)
    assert splits > cluster > 1
    run_case(np.random.default_rng(n_new), capacity=capacity, batch=batch, nheads=32, nheads_kv=nheads_kv,
             seqlen_q=seqlen_q, n_new=n_new, fp8=fp8, page_size=page_size, causal=seqlen_q > 1)


def _expect_cluster_plan(rows, ctas, capacity, fp8, paged, causal, num_splits, expected):
    """The (splits, cluster) dispatch plans on this GPU for such a step (skips off sm_90, or where the GPU
    does not hold the clusters), checked against `expected` where given."""
    device_id = cupy.cuda.Device().id
    if compute_capability(device_id) != 90:
        pytest.skip("thread-block clusters: the decoding kernel merges in them on sm_90")
    cfg = dispatch.decode_config(128, rows, max_smem_per_block(device_id), fp8, 90)
    held = clusters_held(cfg, "float16", paged, causal, score_mods.NONE, device_id)
    plan = dispatch.decode_cluster_plan(cfg, ctas, -(-capacity // cfg.BLOCK_N), sm_count(device_id), 90, held,
                                        num_splits, paged)
    if plan == (0, 0):
        pytest.skip(f"the GPU does not hold {ctas} row blocks' clusters at once ({held})")
    assert expected is None or plan == expected
    return plan


# Short caches whose 32-row tile splits its keys in two: two row blocks of the 16-row tile instead
# (dispatch.decode_halves_rows): MQA at batch 64, 32 heads on 8 with 8 causal queries at batch 8.
HALVED_ROWS_CASES = {"mqa": dict(batch=64, nheads=32, nheads_kv=1),
                     "gqa_nq8": dict(batch=8, nheads=32, nheads_kv=8, seqlen_q=8, n_new=8, causal=True),
                     "mqa_paged": dict(batch=64, nheads=32, nheads_kv=1, page_size=16)}


@pytest.mark.parametrize("case", HALVED_ROWS_CASES)
def test_short_steps_two_row_blocks_of_16(case):
    if compute_capability(cupy.cuda.Device().id) != 90:
        pytest.skip("the 32-row tile these steps would take runs small steps on sm_90")
    kv_cache._plans.clear()
    run_case(np.random.default_rng(64), capacity=1000, **HALVED_ROWS_CASES[case])
    launch = next(iter(kv_cache._plans.plans.values())).launch
    assert (launch.grid[1], launch.threads) == (2, 128)  # two row blocks of the 4-warp 16-row tile


def test_leftpad_and_batch_idx():
    rng = np.random.default_rng(3)
    run_case(rng, leftpad=True, seqlen_q=2, n_new=2, causal=True, capacity=333)
    run_case(rng, batch_idx=True, capacity=333)
    run_case(rng, leftpad=True, batch_idx=True, rotary="half", capacity=333, host_lengths=True)


def test_no_new_keys_and_whole_cache():
    rng = np.random.default_rng(4)
    run_case(rng, n_new=0, capacity=129)
    run_case(rng, n_new=0, capacity=129, lengths=0)  # an empty cache: out 0, lse -inf
    run_case(rng, n_new=0, capacity=129, lengths=129)


def test_int_cache_seqlens_and_strided_q():
    rng = np.random.default_rng(5)
    q_full = cupy.asarray(randn(rng, (2, 3, 16, 64), np.float16))
    q = q_full[:, :, ::2]  # a strided view (nheads 8)
    kc = cupy.asarray(randn(rng, (2, 100, 2, 64), np.float16))
    vc = cupy.asarray(randn(rng, (2, 100, 2, 64), np.float16))
    ref, ref_lse, _, _ = reference.attention_with_kvcache(q.get(), kc.get(), vc.get(), cache_seqlens=60, causal=True)
    naive, _, _, _ = reference.attention_with_kvcache(q.get(), kc.get(), vc.get(), cache_seqlens=60, causal=True,
                                                      lowp_dtype=np.float16)
    for _ in range(2):  # the second call takes the plan
        out, lse = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=60, causal=True, return_lse=True)
        assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])
        check_lse(lse, ref_lse)


@pytest.mark.parametrize("num_splits", [0, 3])  # 3: the in-kernel merge's counts reset on every replay
def test_graph_replay_with_new_lengths(num_splits):
    """A decoding step captured once, replayed with new cache_seqlens values and new tokens."""
    rng = np.random.default_rng(6)
    batch, nheads, nheads_kv, headdim, capacity = 2, 8, 2, 128, 512
    kc = cupy.asarray(randn(rng, (batch, capacity, nheads_kv, headdim), np.float16))
    vc = cupy.asarray(randn(rng, (batch, capacity, nheads_kv, headdim), np.float16))
    q = cupy.zeros((batch, 1, nheads, headdim), np.float16)
    k_new = cupy.zeros((batch, 1, nheads_kv, headdim), np.float16)
    v_new = cupy.zeros_like(k_new)
    seqlens = cupy.zeros(batch, np.int32)
    out = cupy.empty_like(q)
    # The arrays were filled on the null stream, which a non-blocking stream does not wait for.
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, out=out, num_splits=num_splits)
        stream.begin_capture()
        cuflash.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, out=out, num_splits=num_splits)
        graph = stream.end_capture()
    stream.synchronize()  # the eager call's append has landed before the cache is read on the null stream
    for step, lengths in enumerate(([5, 300], [6, 301], [200, 0])):
        host_q, host_k, host_v = (randn(rng, x.shape, np.float16) for x in (q, k_new, v_new))
        before_k, before_v = kc.get(), vc.get()
        with stream:
            q.set(host_q, stream)
            k_new.set(host_k, stream)
            v_new.set(host_v, stream)
            seqlens.set(np.array(lengths, np.int32), stream)
            graph.launch(stream)
        stream.synchronize()
        ref, _, k_after, v_after = reference.attention_with_kvcache(
            host_q, before_k, before_v, host_k, host_v, cache_seqlens=np.array(lengths))
        naive, _, _, _ = reference.attention_with_kvcache(
            host_q, before_k, before_v, host_k, host_v, cache_seqlens=np.array(lengths), lowp_dtype=np.float16)
        assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])
        np.testing.assert_array_equal(kc.get().view(np.int16), k_after.view(np.int16))
        np.testing.assert_array_equal(vc.get().view(np.int16), v_after.view(np.int16))


def test_device_lengths_past_capacity_write_nothing_outside():
    """Device cache_seqlens past the capacity: the kernel clamps; guard rows around the cache keep their poison."""
    rng = np.random.default_rng(8)
    capacity, headdim = 64, 64
    store = cupy.asarray(randn(rng, (3, capacity, 2, headdim), np.float16))
    before = store.get()
    kc, vc = store[1:2], cupy.asarray(randn(rng, (1, capacity, 2, headdim), np.float16))
    q = cupy.asarray(randn(rng, (1, 1, 4, headdim), np.float16))
    k_new = cupy.asarray(randn(rng, (1, 4, 2, headdim), np.float16))
    for length in (capacity - 2, capacity, 10**6, -5):
        out = cuflash.attention_with_kvcache(q, kc, vc, k_new, k_new, cache_seqlens=cupy.array([length], np.int32))
        assert not cupy.isnan(out).any()
    after = store.get()
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[2], before[2])


@pytest.mark.parametrize("headdim", [64, 136])  # neither fills the combine's 128-column passes
def test_combine_partials(headdim):
    """Attention over nine key chunks, merged, equals attention over all keys."""
    rng = np.random.default_rng(9)
    (q, k, v) = (cupy.asarray(randn(rng, (2, n, 4, headdim), np.float16)) for n in (33, 300, 300))
    bounds = [0, 20, 40, 100, 100, 130, 170, 200, 260, 300]  # an empty chunk included
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            o, l = cuflash.attention(q, k[:, lo:hi], v[:, lo:hi], return_lse=True)
        else:
            o, l = cupy.zeros(q.shape, np.float16), cupy.full((2, 4, 33), -np.inf, np.float32)
        outs.append(o.astype(np.float32))
        lses.append(l)
    merged, lse = cuflash.combine_partials(cupy.stack(outs), cupy.stack(lses), out_dtype=np.float16,
                                           return_lse=True)
    whole, whole_lse = cuflash.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(merged.get().astype(np.float32), whole.get().astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse.get(), whole_lse.get(), rtol=1e-5, atol=1e-5)
    assert merged.dtype == np.float16


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [1, 8, 32])  # 1, 8 and 32 packed rows: 4-warp and 8-warp tiles
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache(dtype, group, paged):
    """An e4m3 cache with per-(batch, kv head) descales: the new keys quantised in place."""
    run_case(np.random.default_rng(group + 7 * paged), dtype=dtype, fp8=True, nheads=group * (1 if group == 32 else 2),
             nheads_kv=1 if group == 32 else 2, capacity=517, n_new=2, seqlen_q=1,
             page_size=32 if paged else None)


@pytest.mark.parametrize("name, options", [
    ("speculative", dict(seqlen_q=5, n_new=5, causal=True)),
    ("rotary", dict(seqlen_q=3, n_new=3, causal=True, rotary="half", interleaved=False)),
    ("splits", dict(num_splits=5, capacity=1100, nheads=32, nheads_kv=1)),
    ("splits_merged", dict(num_splits=3, capacity=1100)),
    ("options", dict(seqlen_q=3, n_new=3, window_size=(64, -1), causal=True, softcap=3.0, alibi=True)),
    ("leftpad", dict(leftpad=True, batch_idx=True)),
    ("headdim64", dict(headdim=64, seqlen_q=2, n_new=2, causal=True)),
])
def test_fp8_cache_options(name, options):
    run_case(np.random.default_rng(len(name)), fp8=True, **{"capacity": 400, **options})


@pytest.mark.parametrize("change, arg", [
    (dict(k_cache=lambda c: c[..., ::2]), "k_cache"),
    (dict(v_cache=lambda c: c[::-1]), "v_cache"),  # pages reversed: a negative page stride
    (dict(paged_page_size=24), "page_size"),
    (dict(block_table=lambda t: t.astype(np.int64)), "block_table"),
    (dict(block_table=lambda t: t[:1]), "block_table"),
    (dict(cache_seqlens=lambda s: s[:1]), "cache_seqlens"),
    (dict(cache_seqlens=lambda s: np.array([-1, 3], np.int32)), "cache_seqlens"),
    (dict(cache_seqlens=lambda s: np.array([1000, 3], np.int32)), "cache_seqlens"),
    (dict(v=None), "v"),
    (dict(rotary_cos=lambda c: c[:, :3]), "rotary_cos"),
    (dict(rotary_sin=None), "rotary_sin"),
    (dict(k_descale=lambda _: cupy.ones((2, 2), np.float32)), "k_descale"),  # an fp16 cache
    (dict(k_cache=lambda c: c.view(np.uint8)[..., :64]), "v_cache"),  # fp8 keys, fp16 values
    (dict(q=lambda q: q[:, :0]), "q"),  # no query
])
def test_bad_input(change, arg):
    rng = np.random.default_rng(10)
    page_size = change.get("paged_page_size", 16)
    kc = cupy.asarray(randn(rng, (8, page_size, 2, 64), np.float16))
    args = dict(q=cupy.asarray(randn(rng, (2, 1, 4, 64), np.float16)), k_cache=kc, v_cache=kc.copy(),
                k=cupy.asarray(randn(rng, (2, 1, 2, 64), np.float16)), v=cupy.asarray(randn(rng, (2, 1, 2, 64), np.float16)),
                block_table=cupy.arange(8, dtype=np.int32).reshape(2, 4), cache_seqlens=np.array([3, 5], np.int32),
                rotary_cos=cupy.ones((80, 16), np.float16), rotary_sin=cupy.zeros((80, 16), np.float16))
    for name, fn in change.items():
        if name == "paged_page_size":
            continue
        args[name] = fn(args.get(name)) if callable(fn) else fn
    with pytest.raises((ValueError, TypeError), match=mentions(arg)):
        cuflash.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("k"),
                                       args.pop("v"), **args)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name, options", [
    ("causal", dict(causal=True)),
    ("plain", dict()),
    ("window_softcap_alibi", dict(window_size=(40, -1), causal=True, softcap=4.0, alibi=True)),
])
def test_paged_varlen_prefill(page_size, name, options):
    """attention_varlen with block_table: each sequence's last queries (a prefill chunk) over its paged keys,
    against the float64 varlen reference on the same keys laid out contiguously."""
    rng = np.random.default_rng(page_size + len(name))
    lengths_k, lengths_q = [300, 17, 0, 129, 1, 64], [64, 17, 0, 1, 1, 33]
    nheads, nheads_kv, headdim, dtype = 8, 2, 128, np.float16
    batch = len(lengths_k)
    pages_per = max(-(-n // page_size) for n in lengths_k)
    num_pages = batch * pages_per + 2
    table = rng.permutation(num_pages)[:batch * pages_per].reshape(batch, pages_per).astype(np.int32)
    k_pages, v_pages = (randn(rng, (num_pages, page_size, nheads_kv, headdim), dtype) for _ in range(2))
    k_packed, v_packed = (np.concatenate([pages[table[b]].reshape(-1, nheads_kv, headdim)[:n]
                                          for b, n in enumerate(lengths_k)]) for pages in (k_pages, v_pages))
    q = randn(rng, (sum(lengths_q), nheads, headdim), dtype)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.01, 0.3, (batch, nheads)).astype(np.float32)
    ref, ref_lse = reference.attention_varlen(q, k_packed, v_packed, cu_q, cu_k, return_lse=True, **options)
    naive = reference.attention_varlen_naive_lowp(q, k_packed, v_packed, cu_q, cu_k, dtype=dtype, **options)
    dev = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    out = cupy.full(q.shape, POISON, dtype)
    for cu_qd, cu_kd in ((cu_q, cu_k), (cupy.asarray(cu_q), cupy.asarray(cu_k))):  # host, then device offsets
        result, lse = cuflash.attention_varlen(cupy.asarray(q), cupy.asarray(k_pages), cupy.asarray(v_pages), cu_qd,
                                               cu_kd, max(lengths_q), max(lengths_k), block_table=cupy.asarray(table),
                                               return_lse=True, out=out, **dev)
        assert result is out
        assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(dtype)])
        check_lse(lse, ref_lse)


def test_paged_varlen_prefill_repeats_through_its_plan(rng):
    """Device offsets: a repeated signature takes its plan (fresh q and pages each call, the output
    allocated, then given), each call against the float64 reference."""
    from cuflash import varlen

    case, _, _ = paged_prefill_case(rng, causal=True)
    cu_q, cu_k, table = (cupy.asarray(x) for x in (*case["cu"], case["table"]))
    lengths_k = np.diff(case["cu"][1])
    varlen._fwd_plans.clear()
    for out in (None, None, cupy.full(case["q"].shape, POISON, np.float16)):
        q = randn(rng, case["q"].shape, np.float16)
        pages = [randn(rng, p.shape, np.float16) for p in case["pages"]]
        result = cuflash.attention_varlen(cupy.asarray(q), *(cupy.asarray(p) for p in pages), cu_q, cu_k,
                                          *case["lengths"], block_table=table, causal=True, out=out)
        k_packed, v_packed = (np.concatenate([p[case["table"][b]].reshape(-1, *p.shape[2:])[:n]
                                              for b, n in enumerate(lengths_k)]) for p in pages)
        ref = reference.attention_varlen(q, k_packed, v_packed, *case["cu"], causal=True)
        naive = reference.attention_varlen_naive_lowp(q, k_packed, v_packed, *case["cu"], dtype=np.float16,
                                                      causal=True)
        assert_close_2x(result.get(), ref, naive, ATOL[np.dtype(np.float16)])
    assert len(varlen._fwd_plans.plans) == 2  # one signature without out=, one with


def test_paged_varlen_bad_input():
    rng = np.random.default_rng(11)
    q = cupy.asarray(randn(rng, (10, 4, 64), np.float16))
    pages = cupy.asarray(randn(rng, (4, 24, 2, 64), np.float16))
    cu = np.array([0, 10], np.int32)
    with pytest.raises(ValueError, match=mentions("page_size")):
        cuflash.attention_varlen(q, pages, pages, cu, cu, 10, 10, block_table=cupy.zeros((1, 4), np.int32))
    pages = cupy.asarray(randn(rng, (4, 16, 2, 64), np.float16))
    with pytest.raises(ValueError, match=mentions("block_table")):
        cuflash.attention_varlen(q, pages, pages, cu, cu, 10, 10, block_table=cupy.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match=mentions("cu_seqlens_k")):
        cuflash.attention_varlen(q, pages, pages, cu, np.array([0, 65], np.int32), 10, 65,
                                 block_table=cupy.zeros((1, 4), np.int32))


# Seeded fuzz cases of attention_with_kvcache: a quarter of tests/test_fuzz_gpu.py's count, same variables.
KVCACHE_FUZZ_CASES = max(1, FUZZ_CASES // 4)


def draw_fuzz_case(index):
    """run_case's arguments for case `index`, from its own generator."""
    rng = np.random.default_rng(FUZZ_SEED + 1_000_003 * (index + 1))
    headdim = int(rng.choice([64, 128])) if rng.random() < 0.6 else 8 * int(rng.integers(1, 33))
    nheads_kv = int(rng.integers(1, 5))
    seqlen_q = int(rng.choice([1, 1, 1, 2, 4, 8, 16, int(rng.integers(1, 20))]))
    paged = rng.random() < 0.4
    case = dict(dtype=DTYPES[int(rng.integers(2))], batch=int(rng.integers(1, 5)), seqlen_q=seqlen_q,
                nheads_kv=nheads_kv, nheads=nheads_kv * int(rng.choice([1, 2, 4, 8, 16])), headdim=headdim,
                capacity=int(rng.integers(1, 1500)), num_splits=int(rng.choice([0, 0, 1, int(rng.integers(2, 20))])),
                host_lengths=bool(rng.random() < 0.3))
    case["n_new"] = int(rng.integers(0, min(seqlen_q, case["capacity"]) + 1))
    if rng.random() < 0.25:  # more new keys than queries: with a window, new rows no query attends
        case["n_new"] = int(rng.integers(0, min(seqlen_q + 32, case["capacity"]) + 1))
    if paged:
        case["page_size"] = 16 * int(rng.integers(1, 17))
    else:
        case["leftpad"] = bool(rng.random() < 0.3)
        case["batch_idx"] = bool(rng.random() < 0.3)
    rotary = [None, "full", "half"][int(rng.integers(3))]
    if rotary == "full" and headdim % 16 == 0 or rotary == "half" and headdim % 32 == 0:
        case["rotary"], case["interleaved"] = rotary, bool(rng.random() < 0.5)
    if rng.random() < 0.5:
        case["causal"] = True
    if rng.random() < 0.25:
        case["window_size"] = (int(rng.integers(-1, 300)), int(rng.integers(-1, 20)))
    if rng.random() < 0.25:
        case["softcap"] = float(rng.uniform(1, 50))
    if rng.random() < 0.25:
        case["alibi"] = True
    return case


@pytest.mark.parametrize("index", fuzz_indices(KVCACHE_FUZZ_CASES))
def test_fuzz_kvcache(index):
    case = draw_fuzz_case(index)
    try:
        run_case(np.random.default_rng(FUZZ_SEED + index), **case)
    except AssertionError as exc:
        raise AssertionError(f"kvcache fuzz case {index} (CUFLASH_FUZZ_SEED={FUZZ_SEED}): {case}\n{exc}") from None
