"""Attention gradients: FlashAttention-2 backward by recomputation.

The forward keeps only out and the logsumexp (O(N) memory); the backward
recomputes P tile by tile from them. Kernels are in cuda_src/bwd_sm80.cuh
(every GPU) and cuda_src/bwd_sm90.cuh (head dims 33-128 on compute
capability 9.0: dK/dV with a fused dQ, and a dQ kernel for deterministic mode).
"""

from __future__ import annotations

import dataclasses
import os

import numpy

from . import api, dispatch, tma
from . import compile as _compile
from .config import BWD_ROW_PAD, SM90_SMEM_LIMIT, BwdConfig, kernel_headdim

_LOG2E = 1.4426950408889634

# Kernel head dim -> sm_80 backward tiles, the fast path on GPUs before Hopper.
# Measured on an H200 (the sm_80 kernels there), fwd+bwd, fp16, 16k tokens,
# hidden 2048, seqlen 2k / 8k, against torch SDPA flash in the same run
# (bench/PERFLOG.md, bench/bwd_sweep.py):
# - d64: 128 query rows x 128 keys, 8 warps: 0.92-0.93x non-causal, 0.83-0.90x
#   causal; the 64 x 64, 4-warp tile 0.83-0.85x.
# - d128: 64 x 128, 8 warps: 0.91-0.92x non-causal, 0.89-0.91x causal;
#   128 x 128: 0.92-0.93x non-causal but 0.86-0.87x causal.
# Holding all of a block's scores next to the dK and dV accumulators spills
# (up to 240 bytes at d64, 40 at d128); holding 64 (d64) or 32 (d128) queries'
# scores at a time (dkdv_chunk_m) is spill-free for every variant on sm_80 and
# measured 2-9% (d64) and 9-12% (d128) slower on the H200. The table takes the
# spill-free tiles (the autotuner also tries the whole block); the fallbacks
# for smaller shared memories are chunked likewise.
# - other head dims: unmeasured; tiles that fit the shared memory.
# On compute capability 9.0 the Hopper kernel below replaces the dK/dV tiles
# at head dims 33-128.
HEURISTIC_BWD = {
    32: BwdConfig(32, 128, 8, 4, 64),
    64: BwdConfig(64, 128, 8, 4, 64, dkdv_chunk_m=64),
    96: BwdConfig(96, 64, 8, 4, 64),
    128: BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32),
    160: BwdConfig(160, 32, 4, 4, 32),
    192: BwdConfig(192, 32, 4, 4, 32),
    224: BwdConfig(224, 32, 4, 4, 32),
    256: BwdConfig(256, 32, 4, 4, 32),
}


# Kernel head dim -> the Hopper backward kernels (cuda_src/bwd_sm90.cuh), used
# on compute capability 9.0. Measured on an H200 (bench/bwd_sweep.py, fwd+bwd, fp16, 2k and 8k;
# bench/PERFLOG.md): 1.3-1.6x the sm_80 dK/dV tiles; 3 stages +2-5% over 2 at
# head dim 128; at head dim 64 only 2 fit beside the dS and dQ tiles.
HEURISTIC_BWD_SM90 = {
    kd: BwdConfig(kd, block_m, 8, 8, BwdConfig.HOPPER_DQ_BLOCK_N[kd], stages=stages, hopper=True)
    for kd, block_m, stages in ((64, 128, 2), (128, 64, 3))
}


# Kernel head dims without a Hopper backward of their own that run on the next
# larger one, the extra columns zero-filled by the tensor maps.
SM90_BWD_PADDED = {96: 128}


def hopper_bwd_headdim(kd: int) -> int | None:
    """The Hopper dK/dV kernel's head dim for kernel head dim `kd`, or None if it has none."""
    return kd if kd in BwdConfig.HOPPER_BLOCK_M else SM90_BWD_PADDED.get(kd)


def bwd_fallbacks(kd: int) -> tuple[BwdConfig, ...]:
    """Smaller tiles for GPUs with less shared memory per block than Hopper (A100: 163 KB, sm_86/89: 99 KB)."""
    return (BwdConfig(kd, 64, 4, 4, 64, dkdv_chunk_m=32), BwdConfig(kd, 32, 4, 4, 32, dkdv_chunk_m=16),
            BwdConfig(kd, 32, 2, 2, 16, dkdv_chunk_m=16))


@dataclasses.dataclass(frozen=True)
class BwdProblem:
    """What the backward kernel choice depends on."""

    dtype_name: str
    headdim: int  # the user's head dim
    causal: bool
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per kv head
    deterministic: bool
    max_smem: int = 227 * 1024  # the device's opt-in shared memory per block
    arch: int = 80  # compute capability as major * 10 + minor

    @property
    def kernel_headdim(self) -> int:
        return kernel_headdim(self.headdim)


def fits(cfg: BwdConfig, max_smem: int) -> bool:
    return max(cfg.dkdv_smem_bytes(atomic_dq=True), cfg.dq_smem_bytes()) <= max_smem


def bwd_config(headdim: int, max_smem: int, arch: int = 80, deterministic: bool = False) -> BwdConfig:
    """The Hopper kernels on compute capability 9.0 where they have the head dim; else the sm_80
    table's tiles, or smaller ones where the device has less shared memory per block."""
    kd = kernel_headdim(headdim)
    hopper = HEURISTIC_BWD_SM90.get(hopper_bwd_headdim(kd)) if arch == 90 else None
    if hopper is not None and fits(hopper, max_smem):
        # Deterministic mode (dK/dV, then the dQ kernel) measured 2-10% faster
        # with 2 stages than with 3 at head dim 128 (bench/bwd_sweep.py).
        return dataclasses.replace(hopper, stages=2) if deterministic else hopper
    for cfg in (HEURISTIC_BWD[kd], *bwd_fallbacks(kd)):
        if fits(cfg, max_smem):
            return cfg
    raise RuntimeError(f"cuflash: no backward kernel for head dim {headdim} fits in {max_smem} bytes of shared memory")


def hopper_bwd_plans() -> list[tuple[BwdConfig, bool]]:
    """(config, deterministic) of every Hopper backward the heuristic can pick: what check compiles."""
    return [(bwd_config(kd, SM90_SMEM_LIMIT, 90, det), det) for kd in HEURISTIC_BWD_SM90 for det in (False, True)]


def heuristic_bwd_config(problem: BwdProblem) -> BwdConfig:
    return bwd_config(problem.headdim, problem.max_smem, problem.arch, problem.deterministic)


# Hook for the autotune cache, as dispatch's for the forward: a callable
# (BwdProblem) -> BwdConfig | None, installed by the package.
_cache_lookup = None


def set_cache_lookup(lookup) -> None:
    global _cache_lookup
    _cache_lookup = lookup


def choose_config(problem: BwdProblem) -> tuple[BwdConfig, str]:
    """The config to run and where it came from ("cache" or "heuristic").

    dispatch.heuristic_only() turns the cache off for both passes.
    """
    if _cache_lookup is not None and dispatch.cache_enabled():
        cfg = _cache_lookup(problem)
        if cfg is not None:
            return cfg, "cache"
    return heuristic_bwd_config(problem), "heuristic"


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                       dq=None, dk=None, dv=None, tune=False):
    """Gradients (dq, dk, dv) of attention(q, k, v) given dout = dL/d(out).

    out and lse are the forward's results (`attention(..., return_lse=True)`),
    with the same causal and softmax_scale. GQA: dk and dv sum over the query
    heads that share a kv head. deterministic=True computes dq in a separate
    pass without atomics, so repeated calls give identical bits.
    dq, dk, dv: optional output arrays (shapes and dtype of q, k, v).
    tune: first autotune this problem at this shape unless the tuning cache
    has it (also on with CUFLASH_AUTOTUNE=1), as `attention(..., tune=True)`.
    """
    api._require_cupy_array("dout", dout)
    dtype_name = api._validate_qkv(q, k, v)
    api.validate_like("dout", dout, q, "q")
    api.validate_like("out", out, q, "q")
    api._require_cupy_array("lse", lse)
    batch, seqlen_q, nheads, headdim = q.shape
    if lse.shape != (batch, nheads, seqlen_q):
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {(batch, nheads, seqlen_q)}, got {lse.shape}")
    if lse.dtype != numpy.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    for name, x, ref, ref_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if x is not None:
            api.validate_output(name, x, ref, ref_name)
    scale = api._validate_scale(softmax_scale, headdim)
    causal = bool(causal)
    api._require_device(q.device.id)

    cupy = api._cupy()
    nheads_kv = k.shape[2]
    with q.device:
        dq = cupy.empty(q.shape, q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, v.dtype) if dv is None else dv
        if q.size == 0 or k.size == 0:
            for g in (dq, dk, dv):
                g.fill(0)
            return dq, dk, dv
        q, k, v, dout, out = (x if api._aligned(x) else api.aligned_copy(x) for x in (q, k, v, dout, out))
        lse = cupy.ascontiguousarray(lse)
        problem = BwdProblem(dtype_name, headdim, causal, seqlen_q, k.shape[1], nheads // nheads_kv,
                             bool(deterministic), api.max_smem_per_block(q.device.id),
                             api.compute_capability(q.device.id))
        if tune or os.environ.get("CUFLASH_AUTOTUNE", "0") not in ("", "0"):
            from .tuner import tune_bwd_call

            tune_bwd_call(problem, batch, nheads, nheads_kv)
        cfg, _ = choose_config(problem)
        launch_bwd(cfg, problem, scale, q, k, v, dout, out, lse, dq, dk, dv)
    return dq, dk, dv


def _strides(*arrays):
    return [numpy.int64(s) for x in arrays for s in api._elem_strides(x)[:3]]


def launch_bwd(cfg: BwdConfig, problem: BwdProblem, scale: float, q, k, v, dout, out, lse, dq, dk, dv) -> None:
    """Launch the backward kernels of `cfg` on CuPy's current stream (arguments validated and 16-byte aligned)."""
    dtype_name, causal, deterministic = problem.dtype_name, problem.causal, problem.deterministic
    cupy = api._cupy()
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    nq_pad = -(-seqlen_q // BWD_ROW_PAD) * BWD_ROW_PAD
    even_d = headdim == cfg.headdim
    ints = (numpy.int32(seqlen_q), numpy.int32(seqlen_k), numpy.int32(headdim), numpy.int32(problem.group),
            numpy.int32(nq_pad))
    scales = (numpy.float32(scale * _LOG2E), numpy.float32(scale))

    # Delta = rowsum(dO o O); lse2 = lse * log2(e) (+inf where a row saw no key)
    lse2 = cupy.empty((batch, nheads, nq_pad), cupy.float32)
    delta = cupy.empty((batch, nheads, nq_pad), cupy.float32)
    rows_per_cta = 8
    pre = _compile.get_kernel(cfg.family, BwdConfig.preprocess_name(dtype_name), 0)
    pre(((nq_pad + rows_per_cta - 1) // rows_per_cta, nheads, batch), (32 * rows_per_cta, 1, 1),
        (out, dout, lse, lse2, delta, numpy.int32(seqlen_q), numpy.int32(nq_pad), numpy.int32(headdim),
         *_strides(out, dout)))

    atomic_dq = not deterministic
    dq_accum = cupy.zeros((batch, nheads, nq_pad, cfg.headdim), cupy.float32) if atomic_dq else lse2
    even_n = seqlen_q % cfg.dkdv_block_m == 0 and seqlen_k % cfg.dkdv_block_n == 0
    smem = cfg.dkdv_smem_bytes(atomic_dq)
    dkdv = _compile.get_kernel(cfg.kernel_family, cfg.dkdv_name(dtype_name, causal, even_n, even_d, atomic_dq), smem)
    grid = (-(-seqlen_k // cfg.dkdv_block_n), nheads_kv, batch)
    if cfg.hopper:
        # Q, K, V and dO reach the Hopper kernel as tensor maps (cuflash/tma.py).
        q, k, v, dout = (x if tma.usable(x) else api.aligned_copy(x) for x in (q, k, v, dout))
        maps = (tma.seq_major_map(q, cfg.dkdv_block_m), tma.seq_major_map(k, cfg.dkdv_block_n),
                tma.seq_major_map(v, cfg.dkdv_block_n), tma.seq_major_map(dout, cfg.dkdv_block_m))
        args = (*maps, lse2, delta, dq_accum, dk, dv, *ints, *_strides(dk, dv), *scales)
    else:
        args = (q, k, v, dout, lse2, delta, dq_accum, dk, dv, *ints, *_strides(q, k, v, dout, dk, dv), *scales)
    dkdv(grid, (cfg.dkdv_threads, 1, 1), args, shared_mem=smem)

    if atomic_dq:
        convert = _compile.get_kernel(cfg.kernel_family, cfg.dq_accum_convert_name(dtype_name), 0)
        sizes = (numpy.int32(seqlen_q), numpy.int32(nq_pad), numpy.int32(headdim))
        if not cfg.hopper:
            sizes += (numpy.int32(cfg.headdim),)  # the row length of dq_accum
        convert(((seqlen_q + rows_per_cta - 1) // rows_per_cta, nheads, batch), (32 * rows_per_cta, 1, 1),
                (dq_accum, dq, *sizes, *_strides(dq), numpy.float32(scale)))
    else:
        even_n = seqlen_q % cfg.dq_block_m == 0 and seqlen_k % cfg.dq_block_n == 0
        smem = cfg.dq_smem_bytes()
        dq_kernel = _compile.get_kernel(cfg.kernel_family, cfg.dq_name(dtype_name, causal, even_n, even_d), smem)
        if cfg.hopper:
            maps = (tma.seq_major_map(q, cfg.dq_block_m), tma.seq_major_map(k, cfg.dq_block_n),
                    tma.seq_major_map(v, cfg.dq_block_n), tma.seq_major_map(dout, cfg.dq_block_m))
            args = (*maps, lse2, delta, dq, *ints, *_strides(dq), *scales)
        else:
            args = (q, k, v, dout, lse2, delta, dq, *ints, *_strides(q, k, v, dout, dq), *scales)
        dq_kernel((-(-seqlen_q // cfg.dq_block_m), nheads, batch), (cfg.dq_threads, 1, 1), args, shared_mem=smem)


def attention_vjp(q, k, v, *, causal=False, softmax_scale=None):
    """out = attention(q, k, v) and a function dout -> (dq, dk, dv).

    Keeps only q, k, v, out and the logsumexp alive (O(N) extra memory): the
    glue for jax.custom_vjp, CuPy autodiff or a hand-written training loop.
    """
    api._validate_qkv(q, k, v)  # 16-bit only: no fp8 backward
    out, lse = api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)

    def vjp(dout, *, deterministic=False):
        return attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                  deterministic=deterministic)

    return out, vjp
