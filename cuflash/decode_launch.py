"""Launches of the decoding kernel (cuda_src/decode_sm80.cuh) and of the combine
kernel (cuda_src/combine.cuh) that merges partial results.

`DecodeLaunch` holds what a call's shapes decide (kernel, grid, the packed
`KVCacheArgs`); `run` writes the call's addresses and launches. With split
keys, a row block's split CTAs merge inside thread-block clusters where
dispatch chooses it (sm_90, small steps), a `CombineLaunch` following where a
row block has several; else the kernel's last split CTA of each row block
merges the splits for tiles of up to DECODE_MERGE_MAX_ROWS rows, and for
larger tiles a `CombineLaunch` follows (it also serves
`cuflash.combine_partials`).
"""

from __future__ import annotations

import functools
import threading

import numpy

from .config import DECODE_CLUSTER_MAX, DECODE_MERGE_MAX_ROWS, DecodeConfig, combine_name
from .device import HOPPER, compute_capability, sm_count
from .kernel_call import KernelArgs, LaunchAfterPrior, LaunchInClusters, kernel, max_active_clusters
from .score_mods import ALIBI_SLOPES_WORD

POINTER_FIELDS = ("q", "k_cache", "v_cache", "k_new", "v_new", "out", "lse", "partial_o", "partial_lse",
             "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "cu_seqlens_q", "cu_seqlens_k",
             "rotary_cos", "rotary_sin", "k_descale", "v_descale", "splits_done")
_STRIDES = ("q_sb", "q_sn", "q_sh", "kc_sb", "kc_sn", "kc_sh", "vc_sb", "vc_sn", "vc_sh", "kn_sb", "kn_sn",
            "kn_sh", "vn_sb", "vn_sn", "vn_sh", "o_sb", "o_sn", "o_sh", "block_table_stride")
_INTS = ("nq", "n_new", "nheads", "nheads_kv", "group", "d", "total_q", "cache_len_all", "capacity", "cache_rows",
         "page_size", "page_mul", "page_shift", "rotary_dim", "rotary_interleaved", "rotary_rows", "rotary_q_step",
         "num_splits", "merge_in_cluster")
# KVCacheArgs field for field (cuda_src/kv_cache.cuh).
KV_CACHE_ARGS_DTYPE = numpy.dtype([*((p, "<u8") for p in POINTER_FIELDS), *((s, "<i8") for s in _STRIDES),
                                   *((i, "<u4" if i == "page_mul" else "<i4") for i in _INTS), ("scale_log2", "<f4")],
                                  align=True)
# The pointers are the struct's first words, in POINTER_FIELDS order.
_WORD0 = KV_CACHE_ARGS_DTYPE.fields[POINTER_FIELDS[0]][1] // 8
_OUT, _LSE, _PARTIAL_O, _PARTIAL_LSE = (POINTER_FIELDS.index(n) for n in ("out", "lse", "partial_o", "partial_lse"))
_CACHE_LEN_ALL_WORD, _CACHE_LEN_ALL_HALF = divmod(KV_CACHE_ARGS_DTYPE.fields["cache_len_all"][1], 8)

# CombineArgs field for field (cuda_src/combine.cuh).
COMBINE_ARGS_DTYPE = numpy.dtype([
    ("partial_o", "<u8"), ("partial_lse", "<u8"), ("out", "<u8"), ("lse", "<u8"),
    *((f"{a}_{s}", "<i8") for a in ("po", "pl") for s in ("ss", "sb", "sn", "sh")),
    *((f"{a}_{s}", "<i8") for a in ("o", "l") for s in ("sb", "sn", "sh")),
    ("num_splits", "<i4"), ("batch", "<i4"), ("seqlen", "<i4"), ("nheads", "<i4"), ("d", "<i4"),
], align=True)
COMBINE_ROWS_PER_CTA = 4  # one warp a row
# combine_kernel's prefetching form (its first splits' outputs loaded beside their logsumexps) holds
# 4 CTAs an SM, the plain form 6: the first takes grids of up to this many CTAs an SM, one wave. Same
# process, H100, fp16, head dim 128, 32 query heads, graph replays, plain -> prefetching
# (bench/results/decode_combine_prefetch_ab_h100.txt): MQA batch 1 8k 12.4 -> 12.0 us (8 CTAs), 32 on 2
# batch 1 16k 16.6 -> 15.4, MQA batch 8 8k with 8 queries 33.4 -> 32.6 (512 CTAs); with every grid
# prefetching, batch 64 (4096 CTAs) ran 151.7 -> 155.8.
COMBINE_PREFETCH_MAX_CTAS_PER_SM = 4

# The decoding kernel merges its splits itself in tiles of up to DECODE_MERGE_MAX_ROWS rows. Same-run
# A/B against the combine kernel (bench/decode_merge_ab.py; bench/PERFLOG.md): 1-5% more GB/s with
# 16-row tiles (GQA batch 8 8k 2666 against 2562 GB/s, H100, fp16, head dim 128); with 32-row tiles
# one CTA's merge of 32 rows was slower than the combine kernel's 8-64 CTAs (MQA batch 64 8k 2242
# against 2362, MQA batch 8 128k 2205 against 2511). Up to DECODE_MERGE_MAX_SPLITS splits: the last split
# CTA of a row block reads every split's partial output, a chain that grows with their count, where the
# combine kernel spreads the rows over CTAs. Same process, H100, fp16, head dim 128, batch 1, 128k cache,
# graph replays (bench/results/decode_merge_splits_ab_h100.txt): 32 heads on 2, 122
# splits, 98.5 -> 65.0 us; batch 2, 63 splits, 127.2 -> 104.7; 32 on 4, 63 splits, 110.7 -> 103.8;
# steps of 32 splits or fewer kept their merge (the same time).
DECODE_MERGE_MAX_SPLITS = 32


def division_magic(divisor: int) -> tuple[int, int]:
    """(mul, shift) with n // divisor == (umulhi(n, mul) + n) >> shift for 0 <= n < 2^31
    (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994)."""
    shift = (divisor - 1).bit_length()
    return (1 << 32) * ((1 << shift) - divisor) // divisor + 1, shift


def _words(record) -> numpy.ndarray:
    return numpy.frombuffer(record.tobytes(), numpy.uint64).copy()


class CombineLaunch:
    """combine_kernel over (S, B, N, H, d) partial outputs and (S, B, N, H) logsumexps (by strides)."""

    def __init__(self, out_dtype_name: str, num_splits: int, batch: int, seqlen: int, nheads: int, d: int,
                 po_strides, pl_strides, o_strides, l_strides, device_id: int, after_prior: bool = False):
        """after_prior: launched with programmatic stream serialization (sm_90), so that its CTAs are
        scheduled while the stream's previous kernel (the decoding kernel that wrote the partials)
        finishes; the kernel waits for it before it reads them (LaunchAfterPrior). Only for a launch
        site that holds a lock, as DecodeLaunch.run does."""
        rows = batch * seqlen * nheads
        self.grid = (-(-rows // COMBINE_ROWS_PER_CTA), 1, 1)
        prefetch = self.grid[0] <= COMBINE_PREFETCH_MAX_CTAS_PER_SM * sm_count(device_id)
        self.kernel = kernel("combine", combine_name(out_dtype_name, prefetch), 0, device_id)
        if after_prior:
            self.kernel = LaunchAfterPrior(self.kernel)
        record = numpy.zeros((), COMBINE_ARGS_DTYPE)
        for prefix, strides in (("po", po_strides), ("pl", pl_strides)):
            for suffix, s in zip(("ss", "sb", "sn", "sh"), strides):
                record[f"{prefix}_{suffix}"] = s
        for prefix, strides in (("o", o_strides), ("l", l_strides)):
            for suffix, s in zip(("sb", "sn", "sh"), strides):
                record[f"{prefix}_{suffix}"] = s
        record["num_splits"], record["batch"], record["seqlen"], record["nheads"], record["d"] = (
            num_splits, batch, seqlen, nheads, d)
        self.args = KernelArgs([_words(record)])

    def run(self, partial_o: int, partial_lse: int, out: int, lse: int, stream: int) -> None:
        """Addresses: lse 0 when not wanted."""
        args = self.args
        for word, address in enumerate((partial_o, partial_lse, out, lse)):
            args.set_address(0, address, word)
        self.kernel.launch(self.grid, COMBINE_ROWS_PER_CTA * 32, args, stream)


def clusters_held(cfg: DecodeConfig, dtype_name: str, paged: bool, causal: bool, mods, device_id: int) -> dict:
    """Cluster size (powers of two from 2 to DECODE_CLUSTER_MAX CTAs) -> how many clusters of the
    decoding kernel of `cfg` the device holds at once (0 where it cannot launch them)."""
    return dict(_clusters_held(cfg, dtype_name, paged, causal, mods.bits, device_id))


# Memoised per kernel: every call signature that may cluster asks, and a kernel's answer never changes.
@functools.lru_cache(maxsize=256)
def _clusters_held(cfg: DecodeConfig, dtype_name: str, paged: bool, causal: bool, mod_bits: int,
                   device_id: int) -> tuple:
    decode = kernel(cfg.family, cfg.name_expression(dtype_name, paged, causal, mod_bits), cfg.smem_bytes(), device_id)
    return tuple((size, max_active_clusters(decode, cfg.threads, size))
                 for size in (2 ** k for k in range(1, DECODE_CLUSTER_MAX.bit_length())))


class DecodeLaunch:
    """decode_kernel for one call signature.

    shapes: q (B, nq, H, D); cache (rows, N, Hk, D), paged when `paged`;
    new keys (B, n_new, Hk, D) or n_new = 0.
    """

    def __init__(self, cfg: DecodeConfig, dtype_name: str, paged: bool, causal: bool, mods, q_shape, k_cache,
                 n_new: int, strides: dict, block_table, rotary, num_splits: int, scale: float, device_id: int,
                 total_q: int = 0, cluster: int = 0):
        """strides: element strides of "q", "kc", "vc", "o" and, with new keys, "kn", "vn" (as the kernel
        will see those arrays: an aligned copy's where one is made). A packed batch (paged prefill):
        q_shape (num_seqs, longest, H, D) and total_q, the packed rows; one split. cluster: the splits
        of a row block are thread-block clusters of that many CTAs, which merge them; where a row block
        has several, the combine kernel merges their results (dispatch.decode_cluster_plan)."""
        batch, nq, nheads, headdim = q_shape
        cache_rows, cache_n, nheads_kv = k_cache.shape[:3]
        group = nheads // nheads_kv
        self.kernel = kernel(cfg.family, cfg.name_expression(dtype_name, paged, causal, mods.bits),
                             cfg.smem_bytes(), device_id)
        if cluster:
            self.kernel = LaunchInClusters(self.kernel, (cluster, 1, 1))
        self.grid = (num_splits, -(-nq * group // cfg.block_m), batch * nheads_kv)
        self.cfg = cfg
        self.threads = cfg.threads
        self.num_splits = num_splits
        self.cluster = cluster
        # Partial outputs and their logsumexps in global memory, where results merge through it: each
        # split's, or each cluster's where a row block has several.
        partials = num_splits // cluster if cluster else num_splits
        in_global = partials > 1
        self.partial_o_floats = partials * batch * nq * nheads * headdim if in_global else 0
        self.partial_floats = self.partial_o_floats + (partials * batch * nq * nheads if in_global else 0)
        self.row_blocks = self.grid[1] * self.grid[2]  # one splits_done count each
        self.merge_in_kernel = (in_global and not cluster and cfg.block_m <= DECODE_MERGE_MAX_ROWS
                                and partials <= DECODE_MERGE_MAX_SPLITS)
        record = numpy.zeros((), KV_CACHE_ARGS_DTYPE)
        for prefix, array_strides in strides.items():
            for suffix, s in zip(("sb", "sn", "sh"), array_strides[:3]):
                record[f"{prefix}_{suffix}"] = s
        if paged:
            page_size = cache_n
            capacity = block_table.shape[1] * page_size
            record["block_table_stride"] = block_table.strides[0] // block_table.itemsize
            record["page_size"] = page_size
            record["page_mul"], record["page_shift"] = division_magic(page_size)
        else:
            capacity = cache_n
        record["nq"], record["n_new"], record["nheads"], record["nheads_kv"] = nq, n_new, nheads, nheads_kv
        record["group"], record["d"], record["capacity"], record["cache_rows"] = group, headdim, capacity, cache_rows
        record["total_q"] = total_q
        if rotary is not None:
            cos, interleaved, apart = rotary
            record["rotary_dim"], record["rotary_rows"] = 2 * cos.shape[1], cos.shape[0]
            record["rotary_interleaved"], record["rotary_q_step"] = int(interleaved), int(apart)
        record["num_splits"] = num_splits
        record["merge_in_cluster"] = cluster
        record["scale_log2"] = mods.score_log2(scale)
        self.args = KernelArgs([_words(record), mods.kernel_args(nq, capacity, scale)])
        self.combine = None
        if in_global and not self.merge_in_kernel:
            rows = batch * nq * nheads
            self.combine = CombineLaunch(
                dtype_name, partials, batch, nq, nheads, headdim,
                (rows * headdim, nq * nheads * headdim, nheads * headdim, headdim),
                (rows, nq * nheads, nheads, 1), tuple(strides["o"][:3]), (nheads * nq, 1, nq), device_id,
                after_prior=compute_capability(device_id) >= HOPPER)
        self.last = None
        self.lock = threading.Lock()

    def run(self, addresses: tuple, cache_len_all: int, slopes: int, stream: int, partials: int = 0,
            splits_done: int = 0) -> None:
        """addresses: the device addresses of KVCacheArgs' pointer fields in POINTER_FIELDS order up to
        splits_done (0: absent). With split keys merged through global memory: partials, the address of
        partial_floats float32 values (partial_o and partial_lse), and, where the kernel merges them,
        splits_done: the address of row_blocks int32 counts that are 0."""
        addresses = (*addresses, splits_done)
        if self.partial_floats:
            addresses = (*addresses[:_PARTIAL_O], partials, partials + 4 * self.partial_o_floats,
                         *addresses[_PARTIAL_LSE + 1:])
        with self.lock:
            args = self.args
            # A decoding loop calls with the same arrays step after step: the packed arguments then stand.
            if (addresses, cache_len_all, slopes) != self.last:
                for word, address in enumerate(addresses):
                    args.set_address(0, address, _WORD0 + word)
                self._set_cache_len_all(cache_len_all)
                args.set_address(1, slopes, ALIBI_SLOPES_WORD)
                self.last = (addresses, cache_len_all, slopes)
            self.kernel.launch(self.grid, self.threads, args, stream)
            if self.combine is not None:
                self.combine.run(addresses[_PARTIAL_O], addresses[_PARTIAL_LSE], addresses[_OUT],
                                 addresses[_LSE], stream)

    def _set_cache_len_all(self, value: int) -> None:
        buffer = self.args.buffer
        w = self.args.words[0] + _CACHE_LEN_ALL_WORD
        halves = buffer[w:w + 1].view(numpy.int32)
        halves[_CACHE_LEN_ALL_HALF // 4] = value
