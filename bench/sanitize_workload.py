"""Small awkward-shaped calls of every kernel family, for compute-sanitizer (bench/sanitize.sh).

    PYTHONPATH=. python bench/sanitize_workload.py [FAMILY ...]

Families: fwd_sm80 (head dim 32: the sm_80 kernels on every GPU), bwd_sm80,
fwd_sm90 (fp16, bf16, causal, GQA, the last-wave split), fp8, bwd_sm90
(atomic and deterministic dQ; more key blocks than SMs; head dims 192 and 256's kernels), plan (a repeated forward, then a backward:
the launch-plan path), score_mods (windows, softcap and ALiBi on the sm_80
and Hopper kernels, forward and backward, and fp8 with a window and softcap), varlen
(packed batches with empty, single-row and awkward sequences, plain and with
options, on both kernel families, forward and backward), kvcache (decoding
over contiguous and paged caches, 16-bit and fp8, with appends, rotary and
split keys), dropout
(the sm_80 and Hopper kernels, forward and both backward modes, alone and with
causal GQA and every score option). Each call runs
twice, the second time on its launch plan. Without arguments, all of them.

A forward whose output feeds a backward writes into an output filled with
NaN beforehand: initcheck does not see the Hopper forward's bulk tensor
stores (TMA) as writes, so without the fill it reports the backward's reads
of that output as uninitialised (docs/sanitizers.md). The fill keeps the
check the tool cannot make: every element must be written, else a NaN stays,
and `written` raises.
"""

from __future__ import annotations

import itertools
import sys

import cupy

import cuflash
from cuflash import dispatch, tail_split
from cuflash.bench.inputs import cupy_dtype


def qkv(batch, nq, nk, nheads, nheads_kv, headdim, dtype="float16", seed=0):
    gen = cupy.random.default_rng(seed)
    shapes = ((batch, nq, nheads, headdim), (batch, nk, nheads_kv, headdim), (batch, nk, nheads_kv, headdim))
    return [gen.standard_normal(s, dtype=cupy.float32).astype(cupy_dtype(dtype)) for s in shapes]


def poisoned(like):
    return cupy.full(like.shape, cupy.nan, like.dtype)


def written(out):
    """out, after checking that the forward wrote every element (inputs here are finite)."""
    if bool(cupy.isnan(out).any()):
        raise AssertionError(f"the forward left {int(cupy.isnan(out).sum())} output elements unwritten")
    return out


def forward_and_backward(q, k, v, causal, deterministic=False, backward=True, **options):
    for _ in range(2):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, out=poisoned(q), **options)
        written(out)
        if backward:
            cuflash.attention_backward(cupy.ones_like(q), q, k, v, out, lse, causal=causal,
                                       deterministic=deterministic, **options)


def fwd_sm80():
    forward_and_backward(*qkv(2, 97, 130, 4, 2, 32), causal=True, backward=False)


def bwd_sm80():
    forward_and_backward(*qkv(2, 97, 130, 4, 2, 32), causal=True)


def fwd_sm90():
    for dtype in ("float16", "bfloat16"):
        forward_and_backward(*qkv(2, 97, 257, 4, 2, 128, dtype), causal=False, backward=False)
        forward_and_backward(*qkv(1, 257, 17, 2, 1, 64, dtype), causal=True, backward=False)
    forward_and_backward(*qkv(1, 33, 161, 2, 2, 256, "bfloat16"), causal=True, backward=False)
    forward_and_backward(*qkv(2, 97, 300, 4, 2, 192), causal=False, backward=False)  # 112-key tiles
    forward_and_backward(*qkv(1, 257, 130, 2, 1, 160, "bfloat16"), causal=True, backward=False)  # 80, staged
    saved, tail_split.SEGMENT_COST = tail_split.SEGMENT_COST, 0  # split these short key sequences too
    try:
        forward_and_backward(*qkv(1, 300, 2049, 2 * 50, 50, 128), causal=False, backward=False)
        # ALiBi's column GEMM at head dim 64 splits too: segments take their blocks from the diagonal.
        slopes = cupy.linspace(0.05, 1.0, 2 * 50, dtype=cupy.float32)
        forward_and_backward(*qkv(1, 300, 2049, 2 * 50, 50, 64), causal=False, backward=False, alibi_slopes=slopes)
    finally:
        tail_split.SEGMENT_COST = saved


def fp8():
    x = qkv(1, 97, 300, 2, 2, 128, "float16")  # descales are per (batch, kv head): no GQA here
    (q, qs), (k, ks), (v, vs) = (cuflash.fp8.quantize_e4m3(t.astype(cupy.float32)) for t in x)
    for causal in (False, True):
        cuflash.attention(q, k, v, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)


def bwd_sm90():
    for deterministic in (False, True):
        forward_and_backward(*qkv(2, 97, 130, 4, 2, 128), causal=True, deterministic=deterministic)
        forward_and_backward(*qkv(1, 17, 257, 2, 2, 64), causal=False, deterministic=deterministic)
    # More key blocks than SMs: the persistent dK/dV kernel's CTAs take a second tile from the ticket.
    forward_and_backward(*qkv(2, 17, 2048, 8, 8, 64), causal=False)
    forward_and_backward(*qkv(8, 33, 2048, 4, 2, 128), causal=True)
    # Head dims 192 and 256's kernels (and 160 and 200 zero-padded to them), whose dK/dV consumers
    # meet at a barrier each step: GQA, ragged lengths, Nq < Nk and Nq > Nk.
    for deterministic in (False, True):
        forward_and_backward(*qkv(2, 97, 130, 4, 2, 256), causal=True, deterministic=deterministic)
        forward_and_backward(*qkv(1, 257, 70, 2, 1, 200, "bfloat16"), causal=False, deterministic=deterministic)
        forward_and_backward(*qkv(2, 130, 97, 4, 1, 192), causal=True, deterministic=deterministic)
        forward_and_backward(*qkv(1, 70, 257, 2, 2, 160, "bfloat16"), causal=False, deterministic=deterministic)


def plan():
    q, k, v = qkv(1, 200, 200, 2, 2, 128)
    for _ in range(3):
        out, lse = cuflash.attention(q, k, v, return_lse=True, out=poisoned(q))
    cuflash.attention_backward(cupy.ones_like(q), q, k, v, written(out), lse)


def score_mods():
    slopes = cupy.asarray([0.5, 0.25, 0.125, 0.0625], dtype=cupy.float32)
    # ALiBi alone at head dim 128: the Hopper forward's column GEMM, key blocks from the diagonal without
    # the causal mask.
    options = (dict(window_size=(40, 7)), dict(window_size=(33, -1), causal=True),
               dict(softcap=5.0, alibi_slopes=slopes), dict(window_size=(64, -1), softcap=3.0, alibi_slopes=slopes),
               dict(alibi_slopes=slopes), dict(alibi_slopes=slopes, causal=True))
    for headdim in (32, 64, 128, 256):  # head dim 32: the sm_80 kernels
        for deterministic, opts in zip((False, True) * 3, options):
            opts = {"causal": False, **opts}
            forward_and_backward(*qkv(2, 97, 130, 4, 2, headdim), deterministic=deterministic, **opts)
            forward_and_backward(*qkv(1, 257, 17, 4, 4, headdim), deterministic=deterministic, **opts)
    x = qkv(1, 97, 300, 2, 2, 128, "float16")
    (q, qs), (k, ks), (v, vs) = (cuflash.fp8.quantize_e4m3(t.astype(cupy.float32)) for t in x)
    for opts in (dict(window_size=(50, 0)), dict(softcap=4.0, window_size=(20, 20))):
        cuflash.attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, **opts)


def varlen():
    lengths_q, lengths_k = [17, 0, 1, 130, 64], [33, 5, 0, 129, 64]
    cu_q, cu_k = (cupy.asarray([0, *itertools.accumulate(n)], dtype=cupy.int32) for n in (lengths_q, lengths_k))
    longest = (max(lengths_q), max(lengths_k))
    slopes = cupy.full((len(lengths_q), 4), 0.25, dtype=cupy.float32)
    for headdim in (32, 64, 128):  # head dim 32: the sm_80 kernels
        for deterministic, opts in ((False, dict(causal=True)), (True, dict(window_size=(20, 3), softcap=4.0)),
                                    (False, dict(alibi_slopes=slopes))):
            q, k, v = qkv(1, sum(lengths_q), sum(lengths_k), 4, 2, headdim)
            q, k, v = q[0], k[0], v[0]
            for _ in range(2):
                out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, *longest, return_lse=True,
                                                    out=poisoned(q), **opts)
                cuflash.attention_varlen_backward(cupy.ones_like(q), q, k, v, written(out), lse, cu_q, cu_k,
                                                  *longest, deterministic=deterministic, **opts)
            # seqused on the device, past a span (5 of 1, 40 of 33) and negative (the kernels clamp them),
            # with top-left masks: the rows past them are not written (cuflash zeroes the arrays it makes).
            used = dict(seqused_q=cupy.asarray([9, 0, 5, 130, 1], dtype=cupy.int32),
                        seqused_k=cupy.asarray([40, -3, 0, 100, 64], dtype=cupy.int32), mask_alignment="top_left")
            out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, *longest, return_lse=True, **used, **opts)
            cuflash.attention_varlen_backward(cupy.ones_like(q), q, k, v, out, lse, cu_q, cu_k, *longest,
                                              deterministic=deterministic, **used, **opts)


def kvcache():
    """Decoding over contiguous and paged caches: appends (rotated; new rows outside every query's
    window), device lengths at and past the capacity, split keys merged in thread-block clusters (sm_90, the mma.sync tiles: one cluster a row
    block, or several and the combine kernel), in the kernel through global memory (16-row tiles, 9
    splits) and by the combine kernel (MQA, 64- and 128-row tiles: on sm_90 the wgmma tiles), GQA and
    several queries. The steps run twice: as dispatched (on sm_90 these small steps with more than 32
    packed rows a kv head take the 32-row tile, several row blocks of it), then on the tiles of large
    steps (the wgmma tiles)."""
    kvcache_steps()
    with dispatch.large_step_tiles():
        kvcache_steps()


def kvcache_steps():
    gen = cupy.random.default_rng(3)

    def randn(*shape):
        return gen.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)

    batch, capacity, nheads, nheads_kv, headdim = 3, 200, 8, 2, 64
    cos, sin = randn(capacity + 8, 16), randn(capacity + 8, 16)
    lengths = cupy.asarray([0, 97, capacity + 50], dtype=cupy.int32)  # empty, middle, past the capacity
    contiguous = (randn(batch, capacity, nheads_kv, headdim), randn(batch, capacity, nheads_kv, headdim))
    table = cupy.asarray([[5, 0, 7, 2, 9, 11, 1], [3, 4, 6, 8, 10, 12, 13], [14, 15, 16, 17, 18, 19, 20]],
                         dtype=cupy.int32)
    paged = (randn(21, 32, nheads_kv, headdim), randn(21, 32, nheads_kv, headdim))
    for (k_cache, v_cache), pages in ((contiguous, None), (paged, table)):
        for seqlen_q, splits in ((1, 0), (3, 4), (2, 9)):
            q = randn(batch, seqlen_q, nheads, headdim)
            k_new, v_new = randn(batch, seqlen_q, nheads_kv, headdim), randn(batch, seqlen_q, nheads_kv, headdim)
            for _ in range(2):
                cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                               block_table=pages, rotary_cos=cos, rotary_sin=sin, causal=True,
                                               num_splits=splits, return_lse=True)
    # 32 query heads on one kv head, 2 queries: 64 packed rows, whose splits the combine kernel merges.
    q = randn(batch, 2, 32, headdim)
    k_cache, v_cache = randn(batch, capacity, 1, headdim), randn(batch, capacity, 1, headdim)
    cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=3,
                                   return_lse=True)
    # 32 query heads on one kv head, 1 query: the 8-warp tile (16-bit caches).
    cuflash.attention_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=lengths, num_splits=2)
    # The same over 4160 positions: on sm_90 each row block's splits are two clusters, whose results the
    # combine kernel merges.
    long_cache = randn(batch, 4160, 1, headdim), randn(batch, 4160, 1, headdim)
    cuflash.attention_with_kvcache(q[:, :1], *long_cache, cache_seqlens=cupy.asarray([0, 97, 4210], dtype=cupy.int32),
                                   return_lse=True)
    # One row block (batch 1) over them: on sm_90 clusters of 8, five of them.
    cuflash.attention_with_kvcache(q[:1, :1], *(x[:1] for x in long_cache), cache_seqlens=4160, return_lse=True)
    # 32 query heads on one kv head, 4 queries at head dim 128, paged, appending: 128 packed rows, on
    # sm_90 the wgmma tile of two warpgroups (the 64 rows above: one).
    pages128 = (randn(21, 32, 1, 128), randn(21, 32, 1, 128))
    cuflash.attention_with_kvcache(randn(batch, 4, 32, 128), *pages128, randn(batch, 4, 1, 128),
                                   randn(batch, 4, 1, 128), cache_seqlens=lengths, block_table=table, causal=True,
                                   num_splits=2, return_lse=True)
    # The same rotated, half-split over half the head dim: the wgmma tiles' batched rotary loads.
    cos64, sin64 = randn(capacity + 8, 32), randn(capacity + 8, 32)
    cuflash.attention_with_kvcache(randn(batch, 4, 32, 128), *pages128, randn(batch, 4, 1, 128),
                                   randn(batch, 4, 1, 128), cache_seqlens=lengths, block_table=table,
                                   rotary_cos=cos64, rotary_sin=sin64, rotary_interleaved=False, causal=True,
                                   num_splits=2, return_lse=True)
    # 32 query heads on 8 kv heads, 8 queries at batch 8, appending: on sm_90 two row blocks of the
    # 16-row tile a kv head (dispatch.decode_halves_rows).
    gqa_cache = randn(8, capacity, 8, headdim), randn(8, capacity, 8, headdim)
    gqa_lengths = cupy.asarray([0, 1, 97, 150, 180, 191, 192, 192], dtype=cupy.int32)
    cuflash.attention_with_kvcache(randn(8, 8, 32, headdim), *gqa_cache, randn(8, 8, 8, headdim),
                                   randn(8, 8, 8, headdim), cache_seqlens=gqa_lengths, causal=True, return_lse=True)
    # An fp8 (e4m3) cache, contiguous and paged: appends (rotated, quantised) at the same lengths.
    descales = cupy.full((batch, nheads_kv), 0.25, cupy.float32)
    for k_cache, v_cache in (contiguous, paged):
        k8, v8 = (gen.integers(0, 0x7F, x.shape, dtype=cupy.uint8) for x in (k_cache, v_cache))
        pages = table if k_cache is paged[0] else None
        q = randn(batch, 3, nheads, headdim)
        k_new, v_new = randn(batch, 3, nheads_kv, headdim), randn(batch, 3, nheads_kv, headdim)
        cuflash.attention_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=lengths, block_table=pages,
                                       rotary_cos=cos, rotary_sin=sin, causal=True, k_descale=descales,
                                       v_descale=descales, num_splits=2, return_lse=True)
    # New rows that no query of a row block attends (a window), which the first split of the first row
    # block appends: one row block (GQA), and two (256 packed rows on one kv head: on sm_90 two wgmma
    # tiles), contiguous and paged, at the same lengths.
    for (k_cache, v_cache), pages in ((contiguous, None), (paged, table)):
        cuflash.attention_with_kvcache(randn(batch, 1, nheads, headdim), k_cache, v_cache,
                                       randn(batch, 12, nheads_kv, headdim), randn(batch, 12, nheads_kv, headdim),
                                       cache_seqlens=lengths, block_table=pages, rotary_cos=cos, rotary_sin=sin,
                                       window_size=(3, -1), causal=True, num_splits=3, return_lse=True)
    cuflash.attention_with_kvcache(randn(batch, 8, 32, 128), *pages128, randn(batch, 8, 1, 128),
                                   randn(batch, 8, 1, 128), cache_seqlens=lengths, block_table=table,
                                   window_size=(2, -1), causal=True, num_splits=2, return_lse=True)


def dropout():
    slopes = cupy.asarray([0.5, 0.25, 0.125, 0.0625], dtype=cupy.float32)
    for headdim in (32, 128):  # head dim 32: the sm_80 kernels
        for deterministic in (False, True):
            forward_and_backward(*qkv(2, 97, 130, 4, 2, headdim), causal=False, deterministic=deterministic,
                                 dropout_p=0.2, seed=3, offset=5)
            forward_and_backward(*qkv(1, 257, 65, 4, 1, headdim), causal=True, deterministic=deterministic,
                                 window_size=(40, 0), softcap=4.0, alibi_slopes=slopes, dropout_p=0.1, seed=7,
                                 offset=2**40)


FAMILIES = {f.__name__: f for f in (fwd_sm80, bwd_sm80, fwd_sm90, fp8, bwd_sm90, plan, score_mods, varlen, kvcache,
                                    dropout)}


def main(names) -> None:
    # Without CuPy's pool every array is a cudaMalloc of its own: memcheck sees
    # each one's bounds, and initcheck each one's first write.
    cupy.cuda.set_allocator(None)
    for name in names or FAMILIES:
        FAMILIES[name]()
        cupy.cuda.Device().synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
