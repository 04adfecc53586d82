"""`attention_with_kvcache`: attention of a few new queries over a KV cache, flash-attn's
`flash_attn_with_kvcache` call.

One launch appends the new keys and values to the cache in place (rotated,
with rotary tables), and attends q (rotated) to the cache's keys plus the new
ones; when the (batch, kv head) pairs would not fill the GPU, the keys are
split across CTAs and a second launch merges the splits (cuda_src/combine.cuh).
Semantics and limits: docs/kv_cache.md.
"""

from __future__ import annotations

import dataclasses

import numpy

from . import dispatch, score_mods, validate
from .arrays import (ALIGN_BYTES, aligned_copy, contiguous_strides, dtype_name, elem_strides, is_aligned,
                     last_dim_contiguous, pool_array)
from .config import DecodeConfig
from .decode_launch import DecodeLaunch, clusters_held
from .device import SMEM_RESERVED_PER_CTA, compute_capability, cupy, max_smem_per_block, max_smem_per_sm, sm_count
from .fp8 import check_descale, is_e4m3
from .launch import require_not_capturing, stream_state
from .plans import PlanCache, layout, ndarray_type, option_key, optional_layout

PAGE_MULTIPLE = 16  # page_size granularity (the kernel's 16-row MMA key tiles never straddle pages)
FP8_HEADDIM_MULTIPLE = 16  # an fp8 cache row is read in 16-byte chunks of 16 e4m3 values
FP8_MIN_CAPABILITY = 89  # cvt between e4m3 and f16/f32 (PTX ISA: sm_89)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, causal=False, softmax_scale=None, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, k_descale=None, v_descale=None, num_splits=0,
                           return_lse=False, out=None, lse=None):
    """Attention of q over a KV cache, appending new keys and values in place first.

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16.
    k_cache, v_cache: a contiguous cache (batch_cache, seqlen_cache, nheads_kv, headdim), or
    with block_table a paged one (num_pages, page_size, nheads_kv, headdim), page_size a
    multiple of 16; last dim contiguous, 16-byte aligned rows. nheads % nheads_kv == 0 (GQA/MQA).
    k, v: optional new keys and values (batch, seqlen_new, nheads_kv, headdim), written into
    the cache at positions cache_seqlens[b] .. + seqlen_new before attention.
    cache_seqlens: an int, or int32 (batch,) (CuPy, or NumPy: checked and copied): keys in
    each batch's cache before the call (None: the whole cache). Attention runs over
    positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new).
    cache_batch_idx: int32 (batch,), the cache row of each batch (contiguous caches).
    cache_leftpad: int32 (batch,), each batch's first position (contiguous caches).
    block_table: int32 (batch, max_pages), the pages of each batch's positions.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, rotary_dim a multiple
    of 16 <= headdim: new key t is rotated at position cache_seqlens[b] + t, q row i at
    cache_seqlens[b] + i where the step is causal or has a window, else every row at
    cache_seqlens[b] (flash-attn's convention); interleaved pairs (GPT-J) or halves (GPT-NeoX)
    with rotary_interleaved.
    causal, window_size, softcap, alibi_slopes, softmax_scale: as `cuflash.attention`, with
    seqlen_k = the attended keys of each batch (bottom-right aligned).
    An fp8 cache (sm_89 and later): k_cache and v_cache hold e4m3 (uint8 bits or ml_dtypes'
    float8_e4m3fn), key = e4m3 * k_descale[b, hk] (values likewise); k_descale, v_descale
    float32 (batch, nheads_kv), None meaning 1. New k and v, in q's dtype, are stored as
    e4m3(x / descale), rounded to nearest even and saturated at +-448 (keys after rotary,
    rounded to q's dtype first). Head dim a multiple of 16.
    num_splits: 0 chooses; n >= 1 splits each batch's keys n ways.
    out: optional output (q's shape and dtype, 16-byte aligned).
    lse: optional float32 (batch, nheads, seqlen_q) C-contiguous array to write the logsumexp to.
    Returns out, or (out, lse) with return_lse or lse= (lse float32 (batch, nheads, seqlen_q)).
    """
    descales = (k_descale, v_descale)
    key = _plan_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                    rotary_cos, rotary_sin, rotary_interleaved, causal, softmax_scale, window_size, softcap,
                    alibi_slopes, descales, num_splits, return_lse, out, lse)
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        return plan.call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                         rotary_cos, rotary_sin, alibi_slopes, descales, return_lse, out, lse)
    plan = _validated(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                      rotary_cos, rotary_sin, rotary_interleaved, causal, softmax_scale, window_size, softcap,
                      alibi_slopes, descales, num_splits, out, lse)
    result = plan.call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                       rotary_cos, rotary_sin, alibi_slopes, descales, return_lse, out, lse)
    if key is not None:
        _plans.store(key, plan)
    return result


_plans = PlanCache()


@dataclasses.dataclass
class _Plan:
    """What validation and dispatch decided for a call signature; `call` runs it."""

    launch: DecodeLaunch | None  # None: nothing to compute (an empty q)
    device_id: int
    out_shape: tuple
    out_bytes: int
    lse_shape: tuple
    dtype: numpy.dtype
    capacity: int
    n_new: int
    copy_q: bool
    copy_new: bool
    copy_rotary: bool
    # Rotary tables: their rows, and the positions past cache_seqlens a call rotates (0, 0: none).
    rotary_rows: int = 0
    rotary_extra: int = 0

    def call(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
             rotary_cos, rotary_sin, slopes, descales, return_lse, out, lse):
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with cp.cuda.Device(self.device_id):
                return self.call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                 block_table, rotary_cos, rotary_sin, slopes, descales, return_lse, out, lse)
        cache_len_all, seqlens = _cache_lengths(cache_seqlens, self)
        if type(cache_batch_idx) is numpy.ndarray:
            cache_batch_idx = cp.asarray(cache_batch_idx)
        if type(cache_leftpad) is numpy.ndarray:
            cache_leftpad = cp.asarray(cache_leftpad)
        stream = cp.cuda.get_current_stream()
        if out is None:
            require_not_capturing("attention_with_kvcache without out=", stream)
            out = pool_array(self.out_shape, self.dtype, self.out_bytes)
        return_lse = return_lse or lse is not None
        if return_lse and lse is None:
            require_not_capturing("attention_with_kvcache with return_lse=True and no lse=", stream)
            lse = cp.empty(self.lse_shape, numpy.float32)
        launch = self.launch
        if launch is None:
            if lse is not None:
                lse.fill(-numpy.inf)
            return (out, lse) if return_lse else out
        if self.copy_q:
            q = aligned_copy(q)
        if self.copy_new:
            k, v = aligned_copy(k), aligned_copy(v)
        if self.copy_rotary:
            rotary_cos, rotary_sin = aligned_copy(rotary_cos), aligned_copy(rotary_sin)
        # POINTER_FIELDS order up to splits_done; partial_o, partial_lse and splits_done are the launch's.
        addresses = (q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, _ptr(k), _ptr(v), out.data.ptr, _ptr(lse), 0, 0,
                     _ptr(seqlens), _ptr(cache_batch_idx), _ptr(cache_leftpad), _ptr(block_table), 0, 0,
                     _ptr(rotary_cos), _ptr(rotary_sin), _ptr(descales[0]), _ptr(descales[1]))
        if launch.partial_floats:
            state = stream_state(self.device_id, stream.ptr)
            launch.run(addresses, cache_len_all, _ptr(slopes), stream.ptr,
                       state.partials_for(launch.partial_floats),
                       state.splits_done_for(launch.row_blocks) if launch.merge_in_kernel else 0)
        else:
            launch.run(addresses, cache_len_all, _ptr(slopes), stream.ptr)
        return (out, lse) if return_lse else out


def _ptr(x) -> int:
    return 0 if x is None else x.data.ptr


def _cache_lengths(cache_seqlens, plan: _Plan):
    """(every batch's length when one int is given, the device int32 array otherwise or None)."""
    if cache_seqlens is None:
        cache_seqlens = plan.capacity - plan.n_new
    if (type(cache_seqlens) is int and 0 <= cache_seqlens <= plan.capacity - plan.n_new
            and (not plan.rotary_rows or cache_seqlens + plan.rotary_extra <= plan.rotary_rows)):
        return cache_seqlens, None  # the common host length, valid: no NumPy round trip
    if type(cache_seqlens) is int or validate.is_int(cache_seqlens) or isinstance(cache_seqlens, numpy.ndarray):
        _check_host_lengths(cache_seqlens, plan.capacity, plan.n_new)
        if plan.rotary_rows:
            _check_rotary_rows(cache_seqlens, plan.rotary_extra, plan.rotary_rows)
        if isinstance(cache_seqlens, numpy.ndarray):
            return 0, cupy().asarray(cache_seqlens)
        return int(cache_seqlens), None
    return 0, cache_seqlens


def _check_host_lengths(cache_seqlens, capacity: int, n_new: int, name: str = "cache_seqlens") -> None:
    """Host cache lengths (an int or a NumPy array) must leave room for the new keys."""
    lengths = numpy.asarray(cache_seqlens, numpy.int64).reshape(-1)
    if lengths.min(initial=0) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(lengths.min())}")
    if lengths.max(initial=0) + n_new > capacity:
        raise ValueError(f"{name} + {n_new} new keys must fit the cache's capacity {capacity}, "
                         f"got {name} up to {int(lengths.max())}")


def _check_rotary_rows(cache_seqlens, extra: int, rows: int) -> None:
    """The rotary tables (`rows` rows) must hold every position a call rotates: host cache lengths
    plus `extra` (the kernels clamp device lengths to the last row)."""
    longest = int(numpy.max(numpy.asarray(cache_seqlens, numpy.int64), initial=0)) + extra
    if rows < longest:
        raise ValueError(f"rotary_cos must have a row for every position up to {longest - 1}, got {rows} rows")



def _query_and_cache(q, k_cache, v_cache, block_table, batch: int, cache_batch_idx=None, cache_leftpad=None,
                     names=("k_cache", "v_cache")) -> tuple[str, bool, int, bool]:
    """(dtype name, paged, capacity, fp8) of valid q (4 dims) and cache arrays: `batch` sequences,
    block_table (batch, max_pages) for a paged cache; fp8: the cache holds e4m3."""
    kname, vname = names
    for name, x in (("q", q), (kname, k_cache), (vname, v_cache)):
        validate.require_cupy_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {x.shape}")
    name = dtype_name(q.dtype)
    if name not in ("float16", "bfloat16"):
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    nheads, headdim = q.shape[2:]
    validate.check_headdim(headdim)
    if q.shape[1] == 0:
        raise ValueError(f"q must hold at least one query, got shape {q.shape}")
    if not last_dim_contiguous(q):
        raise ValueError(f"q must be contiguous in its last dim (headdim), got strides {q.strides}")
    if block_table is not None and (k_cache.shape[1] <= 0 or k_cache.shape[1] % PAGE_MULTIPLE != 0):
        raise ValueError(f"page_size ({kname}.shape[1] of a paged cache) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}, got {k_cache.shape[1]}")
    fp8_cache = is_e4m3(k_cache.dtype)
    if fp8_cache:
        _check_fp8_cache(q, k_cache, v_cache, kname, vname)
    for cname, x in ((kname, k_cache), (vname, v_cache)):
        if fp8_cache:
            validate.beside(cname, x, q)  # e4m3 codes: a dtype of their own
        else:
            validate.companion(cname, x, q)
        if not is_aligned(x):
            raise ValueError(f"{cname} must be 16-byte aligned with strides that are multiples of 16 bytes "
                             "(it is read in place, never copied)")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"{kname} must have q's head dim {headdim}, got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{vname} must have {kname}'s shape {k_cache.shape}, got {v_cache.shape}")
    cache_rows, cache_n, nheads_kv = k_cache.shape[:3]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of {kname}'s nheads_kv ({nheads_kv})")
    if cache_rows == 0:
        raise ValueError(f"{kname} must hold at least one {'page' if block_table is not None else 'batch row'}, "
                         f"got shape {k_cache.shape}")
    for cname, x in ((kname, k_cache), (vname, v_cache)):
        _check_row_strides(cname, x, paged=block_table is not None)
    if block_table is None:
        if cache_batch_idx is None and cache_rows < batch:
            raise ValueError(f"{kname} must have at least q's batch size {batch} rows without cache_batch_idx, "
                             f"got shape {k_cache.shape}")
        return name, False, _capacity(cache_n, q.shape[1], f"{kname}.shape[1]"), fp8_cache
    validate.require_cupy_array("block_table", block_table)
    if block_table.dtype != numpy.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape (batch, max_pages) = ({batch}, >= 1), got {block_table.shape}")
    if not last_dim_contiguous(block_table):
        raise ValueError(f"block_table must be contiguous in its last dim, got strides {block_table.strides}")
    validate.same_device("block_table", block_table, q)
    for name_, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None:
            raise ValueError(f"{name_} applies to a contiguous cache, not to a paged one (block_table given)")
    return name, True, _capacity(block_table.shape[1] * cache_n, q.shape[1], "max_pages * page_size"), fp8_cache


def _capacity(capacity: int, seqlen_q: int, what: str) -> int:
    """A cache's capacity in positions, which the kernels count (with the step's queries) in int32."""
    if capacity + seqlen_q >= validate.INT32_ROWS:
        raise ValueError(f"{what}: a cache of {capacity} positions (plus {seqlen_q} queries) exceeds the kernels' "
                         "int32 positions")
    return capacity


# The decoding kernel steps over a cache's positions (and a paged cache's pages) with 32-bit strides
# (cuda_src/kv_cache.cuh: row_at); checked here in bytes, which bounds them in elements too.
ROW_STRIDE_LIMIT = 1 << 32


def _check_row_strides(name: str, x, paged: bool) -> None:
    axes = ((0, "page"), (1, "position")) if paged else ((1, "position"),)
    for axis, what in axes:
        if x.shape[axis] > 1 and not 0 <= x.strides[axis] < ROW_STRIDE_LIMIT:
            raise ValueError(f"{name}: its {what} stride must be between 0 and 2**32 bytes, got strides {x.strides}")


def _check_fp8_cache(q, k_cache, v_cache, kname: str, vname: str) -> None:
    """An e4m3 cache: both halves e4m3, a head dim of whole 16-byte chunks, a GPU with e4m3 conversions."""
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{vname} must have {kname}'s dtype {k_cache.dtype} (an fp8 cache), got {v_cache.dtype}")
    if q.shape[3] % FP8_HEADDIM_MULTIPLE != 0:
        raise ValueError(f"{kname}: an fp8 cache needs a head dim that is a multiple of {FP8_HEADDIM_MULTIPLE}, "
                         f"got {q.shape[3]}")
    capability = compute_capability(q.device.id)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"{kname}: an fp8 (e4m3) cache needs compute capability {FP8_MIN_CAPABILITY // 10}."
                         f"{FP8_MIN_CAPABILITY % 10} or later, device {q.device.id} is {capability // 10}."
                         f"{capability % 10}")


def _check_descales(k_descale, v_descale, fp8_cache: bool, batch: int, nheads_kv: int, q) -> None:
    for name_, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            continue
        if not fp8_cache:
            raise ValueError(f"{name_} applies to an fp8 (e4m3) cache only")
        check_descale(name_, x, batch, nheads_kv, q.device)
        if not x.flags.c_contiguous:
            raise ValueError(f"{name_} must be C-contiguous, got strides {x.strides}")


def _score_options(q, batch: int, causal, softmax_scale, window_size, softcap, alibi_slopes, seqlen_q: int,
                   capacity: int):
    """(causal, ScoreMods, scale) of a call, normalised at seqlen_q queries and at most `capacity` keys."""
    nheads, headdim = q.shape[-2:]
    scale = validate.softmax_scale(softmax_scale, headdim)
    causal = validate.flag("causal", causal)
    window = validate.window_size(window_size, causal)
    cap = validate.softcap(softcap)
    slopes_stride = validate.alibi_slopes(alibi_slopes, batch, nheads)
    if alibi_slopes is not None:
        validate.same_device("alibi_slopes", alibi_slopes, q)
    causal, mods = score_mods.normalise(causal, window, cap, slopes_stride, seqlen_q, capacity)
    return causal, mods, scale


def _validated(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
               rotary_sin, rotary_interleaved, causal, softmax_scale, window_size, softcap, alibi_slopes,
               descales, num_splits, out, lse=None) -> _Plan:
    validate.require_cupy_array("q", q)
    batch = q.shape[0] if q.ndim == 4 else 0
    name, paged, capacity, fp8_cache = _query_and_cache(q, k_cache, v_cache, block_table, batch, cache_batch_idx,
                                                        cache_leftpad)
    batch, seqlen_q, nheads, headdim = q.shape
    cache_rows, nheads_kv = k_cache.shape[0], k_cache.shape[2]
    _check_descales(*descales, fp8_cache, batch, nheads_kv, q)

    n_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    copy_new = False
    if k is not None:
        for name_, x in (("k", k), ("v", v)):
            validate.require_cupy_array(name_, x)
            expected = (batch, x.shape[1] if x.ndim == 4 else -1, nheads_kv, headdim)
            if x.ndim != 4 or x.shape != expected:
                raise ValueError(f"{name_} must have shape (batch, seqlen_new, nheads_kv, headdim) = "
                                 f"({batch}, seqlen_new, {nheads_kv}, {headdim}), got {x.shape}")
            validate.companion(name_, x, q)
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
        n_new = k.shape[1]
        copy_new = not (is_aligned(k) and is_aligned(v))
    if n_new > capacity:
        raise ValueError(f"k: {n_new} new keys exceed the cache's capacity {capacity}")

    validate.int32_vector("cache_batch_idx", cache_batch_idx, batch, upper=cache_rows)
    if n_new and isinstance(cache_batch_idx, numpy.ndarray) and numpy.unique(cache_batch_idx).size < batch:
        raise ValueError("cache_batch_idx must not repeat a cache row when new keys are appended (k, v): two "
                         f"batches would write the same row, got {cache_batch_idx.tolist()}")
    if cache_seqlens is not None and not validate.is_int(cache_seqlens):
        validate.int32_vector("cache_seqlens", cache_seqlens, batch)
    # Every batch's length where the host has it (None: the cache's capacity less the new keys).
    if cache_seqlens is None or validate.is_int(cache_seqlens):
        host_lengths = numpy.full(batch, capacity - n_new if cache_seqlens is None else int(cache_seqlens),
                                  numpy.int64)
    else:
        host_lengths = cache_seqlens if isinstance(cache_seqlens, numpy.ndarray) else None
    if host_lengths is not None:
        _check_host_lengths(host_lengths, capacity, n_new)
    if cache_leftpad is not None:
        validate.int32_vector("cache_leftpad", cache_leftpad, batch, upper=capacity + 1)
        if isinstance(cache_leftpad, numpy.ndarray) and host_lengths is not None:
            over = cache_leftpad > host_lengths
            if numpy.any(over):
                at = int(numpy.argmax(over))
                raise ValueError(f"cache_leftpad[{at}] = {int(cache_leftpad[at])} exceeds cache_seqlens[{at}] = "
                                 f"{int(host_lengths[at])}")

    rotary = None
    copy_rotary = False
    rotary_extra = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name_, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            validate.require_cupy_array(name_, x)
            if x.ndim != 2 or x.shape[1] == 0 or x.shape[0] == 0:
                raise ValueError(f"{name_} must have shape (seqlen_ro, rotary_dim / 2), got {x.shape}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name_} must have q's dtype {q.dtype}, got {x.dtype}")
            validate.same_device(name_, x, q)
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {rotary_cos.shape}, got {rotary_sin.shape}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim % 16 != 0 or rotary_dim > headdim:
            raise ValueError(f"rotary_cos: rotary_dim = 2 * shape[1] must be a multiple of 16 and at most headdim "
                             f"{headdim}, got {rotary_dim}")
        causal = validate.flag("causal", causal)
        apart = score_mods.queries_rotate_apart(causal, validate.window_size(window_size, causal), capacity)
        rotary_extra = max(seqlen_q if apart else min(seqlen_q, 1), n_new)
        if host_lengths is not None:
            _check_rotary_rows(host_lengths, rotary_extra, rotary_cos.shape[0])
        rotary = (rotary_cos, validate.flag("rotary_interleaved", rotary_interleaved), apart)
        # The kernels read the tables' rows as 8-byte vectors where a thread rotates several chunks at once.
        copy_rotary = not all(x.flags.c_contiguous and x.data.ptr % ALIGN_BYTES == 0
                              for x in (rotary_cos, rotary_sin))

    causal, mods, scale = _score_options(q, batch, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                         seqlen_q, capacity)
    if isinstance(num_splits, bool) or not validate.is_int(num_splits) or not 0 <= num_splits <= \
            dispatch.DECODE_MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {dispatch.DECODE_MAX_SPLITS}] (0: chosen), "
                         f"got {num_splits!r}")
    if out is not None:
        validate.output("out", out, q, "q")
    if lse is not None:
        validate.lse_array("lse", lse, q, writable=True)
    # The caches are written too where new keys are appended.
    written = {"out": out, "lse": lse, "k_cache": k_cache if n_new else None, "v_cache": v_cache if n_new else None}
    validate.disjoint(written, {"q": q, "k": k, "v": v, "k_cache": None if n_new else k_cache,
                                "v_cache": None if n_new else v_cache})
    device_id = validate.cuda_device(q)
    for name_, x in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                     ("cache_leftpad", cache_leftpad)):
        if isinstance(x, cupy().ndarray):
            validate.same_device(name_, x, q)

    plan = _Plan(None, device_id, q.shape, q.size * q.dtype.itemsize, (batch, nheads, seqlen_q), q.dtype, capacity,
                 n_new, not is_aligned(q), copy_new, copy_rotary, 0 if rotary is None else rotary_cos.shape[0],
                 rotary_extra)
    rows = seqlen_q * (nheads // nheads_kv)
    if batch == 0 or (rows == 0 and n_new == 0):
        return plan
    arch = compute_capability(device_id)
    key_blocks, sms = -(-capacity // DecodeConfig.BLOCK_N), sm_count(device_id)
    cfg = dispatch.decode_config(headdim, max(rows, 1), max_smem_per_block(device_id), fp8_cache, arch,
                                 batch * nheads_kv * key_blocks / sms)
    row_blocks = -(-max(rows, 1) // cfg.block_m)
    if row_blocks > validate.MAX_GRID_YZ or batch * nheads_kv > validate.MAX_GRID_YZ:
        raise ValueError(f"q: seqlen_q * nheads / nheads_kv ({rows}) and batch * nheads_kv "
                         f"({batch * nheads_kv}) are too large for the decoding kernel's grid")

    def plan_splits(tile: DecodeConfig) -> tuple[int, int, int, int]:
        """(CTAs of the grid, slots, splits, CTAs a cluster) of this step on `tile`; CTAs beyond the slots
        (dispatch.decode_slots) make a second wave."""
        ctas = batch * nheads_kv * -(-max(rows, 1) // tile.block_m)
        per_sm = max(1, max_smem_per_sm(device_id) // (tile.smem_bytes() + SMEM_RESERVED_PER_CTA))
        slots = dispatch.decode_slots(tile, per_sm, sms)
        held = clusters_held(tile, name, paged, causal, mods, device_id) if dispatch.decode_may_cluster(
            tile, ctas, sms, arch) else {}
        splits, cluster = dispatch.decode_cluster_plan(tile, ctas, key_blocks, sms, arch, held, num_splits, paged)
        if not splits:
            splits = num_splits or dispatch.decode_split_count(tile, ctas, key_blocks, slots, sms, paged)
        return ctas * splits, slots, splits, cluster

    _, _, splits, cluster = plan_splits(cfg)
    if not num_splits and dispatch.decode_halves_rows(cfg, rows, key_blocks, splits, arch):
        half = dispatch.decode_config(headdim, 16, max_smem_per_block(device_id), fp8_cache, arch)
        half_ctas, half_slots, half_splits, half_cluster = plan_splits(half)
        if half_ctas <= half_slots:  # one wave
            cfg, splits, cluster = half, half_splits, half_cluster

    def kernel_strides(x, copied: bool):
        return contiguous_strides(x.shape) if copied else elem_strides(x)

    strides = {"q": kernel_strides(q, plan.copy_q), "kc": elem_strides(k_cache), "vc": elem_strides(v_cache),
               "o": elem_strides(out) if out is not None else contiguous_strides(q.shape)}
    if k is not None:
        strides["kn"], strides["vn"] = kernel_strides(k, copy_new), kernel_strides(v, copy_new)
    plan.launch = DecodeLaunch(cfg, name, paged, causal, mods, q.shape, k_cache, n_new, strides, block_table,
                               rotary, splits, scale, device_id, cluster=cluster)
    return plan


def _plan_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
              rotary_sin, rotary_interleaved, causal, softmax_scale, window_size, softcap, alibi_slopes, descales,
              num_splits, return_lse, out, lse):
    """The plan key of a call, or None where only the full path applies."""
    ndarray = ndarray_type()
    if type(q) is not ndarray or type(k_cache) is not ndarray or type(v_cache) is not ndarray:
        return None
    options = option_key(window_size, softcap, softmax_scale)
    if options is None or type(num_splits) is not int:
        return None
    if cache_seqlens is None or type(cache_seqlens) is int:
        lengths = type(cache_seqlens)
    elif type(cache_seqlens) is ndarray:
        lengths = optional_layout(cache_seqlens)
    else:
        return None  # NumPy lengths: checked per call on the full path
    arrays = []
    for x in (q, k_cache, v_cache, k, v, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin,
              alibi_slopes, *descales, out, lse):
        if x is None:
            arrays.append(None)
        elif type(x) is ndarray:
            arrays.append(layout(x))
        else:
            return None
    arrays = tuple(arrays)
    if type(rotary_interleaved) is not bool or type(causal) is not bool:
        return None
    return (arrays, lengths, rotary_interleaved, causal, options, num_splits, dispatch.small_step_tiles())


@dataclasses.dataclass(frozen=True)
class PagedPrefillPlan:
    """A paged prefill's launch for one call signature (shapes, strides, dtypes, options): a repeat
    with that signature allocates the outputs it is not given and launches."""
    launch: DecodeLaunch
    device_id: int

    def call(self, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, out, lse):
        """(out, lse) of the call; the offsets on q's device, out and lse validated where given."""
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with q.device:
                return self.call(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, out,
                                 lse)
        stream = cp.cuda.get_current_stream()
        if out is None or lse is None:
            require_not_capturing("attention_varlen with block_table, without out= and lse=", stream)
            out = pool_array(q.shape, q.dtype, q.nbytes) if out is None else out
            lse = cp.empty((q.shape[1], q.shape[0]), numpy.float32) if lse is None else lse
        q_ = q if is_aligned(q[None]) else aligned_copy(q)
        addresses = (q_.data.ptr, k_cache.data.ptr, v_cache.data.ptr, 0, 0, out.data.ptr, lse.data.ptr, 0, 0, 0, 0, 0,
                     block_table.data.ptr, cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr, 0, 0, 0, 0)
        self.launch.run(addresses, 0, _ptr(alibi_slopes), stream.ptr)
        return out, lse


def attention_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, block_table, *,
                           causal, window_size, softcap, alibi_slopes, softmax_scale, out, lse, host_key_lengths=None):
    """`attention_varlen` over a paged cache (chunked prefill): q (total_q, H, D) packed by cu_seqlens_q,
    sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of its pages in
    block_table. The offsets arrive validated and on q's device (host_key_lengths: the keys per
    sequence where the caller had them on the host); out and lse too where given.
    Returns (out, lse (H, total_q), the call's PagedPrefillPlan or None where nothing was launched)."""
    total_q, nheads, headdim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    name, _, capacity, fp8_cache = _query_and_cache(q[None], k_cache, v_cache, block_table, num_seqs,
                                                    names=("k", "v"))
    if fp8_cache:
        raise TypeError("k: attention_varlen reads a paged cache of q's dtype; an fp8 cache is read by "
                        "attention_with_kvcache")
    causal, mods, scale = _score_options(q, num_seqs, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                         max_seqlen_q, capacity)
    if host_key_lengths is not None:
        _check_host_lengths(host_key_lengths, capacity, 0, "cu_seqlens_k (keys per sequence)")
    device_id = validate.cuda_device(q)
    group = nheads // k_cache.shape[2]
    cfg = dispatch.decode_config(headdim, max_seqlen_q * group, max_smem_per_block(device_id),
                                 arch=compute_capability(device_id))
    if -(-max_seqlen_q * group // cfg.block_m) > validate.MAX_GRID_YZ:
        raise ValueError(f"max_seqlen_q * nheads / nheads_kv ({max_seqlen_q * group}) is too large for the paged "
                         "kernel's grid")
    cp = cupy()
    with q.device:
        if total_q == 0:
            if out is None or lse is None:
                require_not_capturing("attention_varlen with block_table, without out= and lse=")
            out = cp.empty(q.shape, q.dtype) if out is None else out
            lse = cp.empty((nheads, total_q), numpy.float32) if lse is None else lse
            return out, lse, None
        q_strides = elem_strides(q[None]) if is_aligned(q[None]) else contiguous_strides((1, *q.shape))
        out_strides = elem_strides(out[None]) if out is not None else contiguous_strides((1, *q.shape))
        launch = DecodeLaunch(cfg, name, True, causal, mods, (num_seqs, max_seqlen_q, nheads, headdim), k_cache, 0,
                              {"q": q_strides, "kc": elem_strides(k_cache), "vc": elem_strides(v_cache),
                               "o": out_strides}, block_table, None, 1, scale, device_id, total_q=total_q)
        plan = PagedPrefillPlan(launch, device_id)
        return (*plan.call(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, out, lse),
                plan)
