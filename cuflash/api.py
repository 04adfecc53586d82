"""Public entry points: argument validation, layout normalisation, launch.

Layout follows flash-attn: q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_kv, headdim), any strides with a contiguous last dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading

import numpy

from . import compile as _compile
from . import dispatch, fp8, tail_split, tma, tune_cache
from .config import FP8_DTYPE_NAME

try:  # CuPy holds bfloat16 arrays through ml_dtypes
    import ml_dtypes

    _BF16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _BF16 = None

_LOG2E = 1.4426950408889634
MAX_HEADDIM = 256
MIN_COMPUTE_CAPABILITY = 80
# cp.async and TMA move 16-byte chunks: base pointers and the batch/seq/head
# strides must be multiples of 16 bytes.
_ALIGN_BYTES = 16
HOPPER = 90


def _cupy():
    import cupy

    return cupy


def _dtype_name(dtype) -> str | None:
    if dtype == numpy.float16:
        return "float16"
    if _BF16 is not None and dtype == _BF16:
        return "bfloat16"
    if fp8.is_e4m3(dtype):
        return FP8_DTYPE_NAME
    return None


def out_dtype(dtype_name: str, in_dtype):
    """The output dtype: the input's, bfloat16 for fp8 inputs."""
    return _BF16 if dtype_name == FP8_DTYPE_NAME else in_dtype


def _require_cupy_array(name: str, x) -> None:
    cupy = _cupy()
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")


@functools.lru_cache(maxsize=None)
def _require_device(device_id: int) -> None:
    """Raises unless device_id is a GPU cuflash runs on (a pass is memoised: it is asked on every call)."""
    cupy = _cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver / no device
        raise RuntimeError(f"cuflash needs a CUDA GPU: {exc}") from None
    if count == 0:
        raise RuntimeError("cuflash needs a CUDA GPU; none was found")
    cc = compute_capability(device_id)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"cuflash needs compute capability 8.0 (Ampere) or newer; device {device_id} has {cc // 10}.{cc % 10}"
        )


@functools.lru_cache(maxsize=None)
def max_smem_per_block(device_id: int) -> int:
    """Opt-in dynamic shared memory per block of a device, in bytes."""
    return int(_cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device."""
    return int(_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    """Compute capability of a device as major * 10 + minor (90 for H100/H200)."""
    return int(_cupy().cuda.Device(device_id).compute_capability)


def _elem_strides(x) -> tuple[int, ...]:
    # Dims of extent 1 are never stepped over: their stride is irrelevant.
    return tuple(0 if n == 1 else s // x.itemsize for n, s in zip(x.shape, x.strides))


def _last_dim_contiguous(x) -> bool:
    return x.shape[-1] == 1 or x.strides[-1] == x.itemsize


def aligned_copy(x):
    """A C-contiguous copy of x in fresh memory (CuPy's pool aligns blocks to 256 bytes).

    cupy.ascontiguousarray would return a contiguous but misaligned x itself.
    """
    return x.copy(order="C")


def _aligned(x) -> bool:
    if x.data.ptr % _ALIGN_BYTES != 0:
        return False
    return all(s * x.itemsize % _ALIGN_BYTES == 0 for s in _elem_strides(x)[:3])


def _validate_scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def _validate_qkv(q, k, v, allow_fp8: bool = False) -> str:
    """The dtype name of valid q, k, v (fp8 only where allow_fp8: the forward)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_cupy_array(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got shape {x.shape}")
    dtype_name = _dtype_name(q.dtype)
    if dtype_name == FP8_DTYPE_NAME and not allow_fp8:
        raise TypeError(f"q must be float16 or bfloat16 (fp8 attention is forward-only), got {q.dtype}")
    if dtype_name is None:
        raise TypeError(f"q must be float16, bfloat16 or fp8 e4m3 (uint8 bits), got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    batch, _, nheads, headdim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have q's batch size {batch}, got shape {k.shape}")
    if k.shape[3] != headdim:
        raise ValueError(f"k must have q's head dim {headdim}, got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
    if headdim % 8 != 0 or not 8 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"q: head dim must be a multiple of 8 between 8 and {MAX_HEADDIM}, got {headdim}")
    if dtype_name == FP8_DTYPE_NAME and headdim % 16 != 0:
        raise ValueError(f"q: fp8 head dim must be a multiple of 16 (16-byte rows), got {headdim}")
    nheads_kv = k.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k's nheads_kv ({nheads_kv})")
    if batch > 65535 or nheads > 65535:
        raise ValueError(f"q: batch and nheads must each be at most 65535, got shape {q.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _last_dim_contiguous(x):
            raise ValueError(f"{name} must be contiguous in its last dim (headdim), got strides {x.strides}")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    return dtype_name


def validate_like(name: str, x, ref, ref_name: str, dtype=None) -> None:
    """x must be a CuPy array with ref's shape, dtype (or `dtype`) and device and a contiguous last dim."""
    _require_cupy_array(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {ref.shape}, got {x.shape}")
    if dtype is not None:
        if x.dtype != dtype:
            raise TypeError(f"{name} must be {numpy.dtype(dtype).name}, got {x.dtype}")
    elif x.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on device {x.device.id}, {ref_name} on device {ref.device.id}")
    if not _last_dim_contiguous(x):
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.strides}")


def validate_output(name: str, x, ref, ref_name: str, dtype=None) -> None:
    """An output array the kernels write in place (never copied): validate_like plus alignment."""
    validate_like(name, x, ref, ref_name, dtype)
    if not _aligned(x):
        raise ValueError(f"{name} must be 16-byte aligned with batch/seq/head strides that are multiples of 8 elements")


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, tune=False,
              q_descale=None, k_descale=None, v_descale=None):
    """Exact attention softmax(q k^T * softmax_scale) v, FlashAttention style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    cupy float16 or bfloat16, last dim contiguous. nheads must be a multiple of
    nheads_kv (GQA/MQA: query head h reads kv head h // (nheads // nheads_kv)).
    fp8: q, k, v as uint8 arrays holding float8 e4m3 bits (Hopper only, head
    dim a multiple of 16); the real inputs are q * q_descale, k * k_descale,
    v * v_descale with positive float32 descales of shape (batch, nheads_kv)
    (ones when None); out is bfloat16.
    causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned);
    a row that sees no key gets output 0 and lse -inf.
    softmax_scale: defaults to 1 / sqrt(headdim).
    Returns out (q's shape and dtype); with return_lse=True, (out, lse) where lse
    is float32 (batch, nheads, seqlen_q), natural log.
    tune: first autotune this problem at this shape unless the tuning cache
    already holds it (as does the environment variable CUFLASH_AUTOTUNE=1;
    fp8 problems run the heuristic's kernel).
    """
    key = None
    if out is None and not tune and q_descale is None and k_descale is None and v_descale is None:
        key = _plan_key(q, k, v, causal, softmax_scale)
        plan = _fwd_plans.get(key) if key is not None else None
        if plan is not None:
            return _run_plan(plan, q, k, v, return_lse)
    dtype_name = _validate_qkv(q, k, v, allow_fp8=True)
    is_fp8 = dtype_name == FP8_DTYPE_NAME
    scale = _validate_scale(softmax_scale, q.shape[3])
    result_dtype = out_dtype(dtype_name, q.dtype)
    if out is not None:
        validate_output("out", out, q, "q", result_dtype)
    causal = bool(causal)
    cupy = _cupy()
    _require_device(q.device.id)
    if is_fp8 and compute_capability(q.device.id) != HOPPER:
        raise RuntimeError(f"cuflash: fp8 attention needs a Hopper GPU (compute capability 9.0); device "
                           f"{q.device.id} has {compute_capability(q.device.id) / 10:.1f}")

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    descale = fp8.validate_descales(q_descale, k_descale, v_descale, batch, nheads_kv, is_fp8, q.device)
    with q.device:
        if out is None:
            out = cupy.empty(q.shape, dtype=result_dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        if seqlen_q == 0 or batch == 0 or nheads == 0:
            return (out, lse) if return_lse else out
        if seqlen_k == 0:
            out.fill(0)
            lse.fill(-numpy.inf)
            return (out, lse) if return_lse else out
        q_, k_, v_ = (x if _aligned(x) else aligned_copy(x) for x in (q, k, v))

        problem = dispatch.FwdProblem(
            dtype_name,
            headdim,
            causal,
            seqlen_q,
            seqlen_k,
            nheads // nheads_kv,
            max_smem_per_block(q.device.id),
            compute_capability(q.device.id),
        )
        autotune = tune or os.environ.get("CUFLASH_AUTOTUNE", "0") not in ("", "0")
        if not is_fp8 and autotune:
            from .tuner import tune_call

            tune_call(problem, batch, nheads, nheads_kv)
        cfg, _ = dispatch.fwd_config(problem)
        launch_fwd(cfg, problem, q_, k_, v_, out, lse, scale, descale)
    # Not stored under autotuning (every call may tune) nor for fp8 (descales).
    if key is not None and not is_fp8 and not autotune:
        _store_plan(key, _FwdPlan(problem, cfg, scale, tuple(x is not y for x, y in ((q, q_), (k, k_), (v, v_)))))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- repeated calls
# A plain forward call's launch plan (what validation and dispatch decided),
# keyed by everything they read: the arrays' types, shapes, strides, dtypes,
# devices and base-pointer alignment, the mask, the scale, the dispatcher's
# cache hook and switch, the tuning cache's generation and the environment
# variables that locate it or turn tuning on. Loops repeat their shapes: a
# hit skips validation, dispatch and the tuning-cache lookup, which took over
# half of the ~130 us of host time per call (H100, cProfile), about what a
# 512-token forward kernel runs on the GPU. Plans are only stored after a
# launch, so an argument that fails validation never has one.
_FWD_PLANS_MAX = 512
_fwd_plans: dict = {}
_fwd_plans_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _FwdPlan:
    problem: dispatch.FwdProblem
    cfg: object
    scale: float
    copies: tuple  # whether q, k, v go to the kernel as contiguous copies (misaligned)


def _plan_key(q, k, v, causal, softmax_scale):
    """The plan key of a call with these arguments, or None where only the full path applies."""
    ndarray = _cupy().ndarray
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    if softmax_scale is not None and type(softmax_scale) is not float:
        return None
    env = os.environ
    return (q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, q.dtype, k.dtype, v.dtype,
            q.device.id, k.device.id, v.device.id, q.data.ptr % _ALIGN_BYTES, k.data.ptr % _ALIGN_BYTES,
            v.data.ptr % _ALIGN_BYTES, bool(causal), softmax_scale, dispatch.cache_state(),
            tune_cache.generation(), env.get("CUFLASH_AUTOTUNE"), env.get("CUFLASH_CACHE_DIR"),
            env.get("XDG_CACHE_HOME"), env.get("HOME"))


def _store_plan(key, plan: _FwdPlan) -> None:
    with _fwd_plans_lock:  # two threads may evict at once
        if len(_fwd_plans) >= _FWD_PLANS_MAX:
            del _fwd_plans[next(iter(_fwd_plans))]  # the first stored (hits do not refresh a plan)
        _fwd_plans[key] = plan


def _run_plan(plan: _FwdPlan, q, k, v, return_lse: bool):
    cupy = _cupy()
    batch, seqlen_q, nheads, _ = q.shape
    with q.device:
        out = cupy.empty(q.shape, dtype=q.dtype)  # plans are 16-bit only: out has q's dtype
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        q_, k_, v_ = (aligned_copy(x) if copy else x for x, copy in zip((q, k, v), plan.copies))
        launch_fwd(plan.cfg, plan.problem, q_, k_, v_, out, lse, plan.scale)
    return (out, lse) if return_lse else out


def launch_fwd(cfg, problem, q, k, v, out, lse, scale: float, descale=None) -> None:
    """Launch the forward kernel `cfg` on CuPy's current stream (arguments validated and 16-byte aligned).

    descale: for fp8 inputs, the (q, k, v) descale arrays of fp8.validate_descales.
    """
    if cfg.family == "fwd_sm90":
        _launch_fwd_sm90(cfg, problem, q, k, v, out, lse, scale, descale)
        return
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    even_n = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
    even_d = headdim == cfg.headdim
    name = cfg.name_expression(problem.dtype_name, problem.causal, even_n, even_d)
    kernel = _compile.get_kernel(cfg.family, name, cfg.smem_bytes())
    strides = [numpy.int64(s) for x in (q, k, v, out) for s in _elem_strides(x)[:3]]
    grid = ((seqlen_q + cfg.block_m - 1) // cfg.block_m, nheads, batch)
    args = (
        q,
        k,
        v,
        out,
        lse,
        numpy.int32(seqlen_q),
        numpy.int32(seqlen_k),
        numpy.int32(headdim),
        numpy.int32(problem.group),
        *strides,
        numpy.float32(scale * _LOG2E),
    )
    kernel(grid, (cfg.threads, 1, 1), args, shared_mem=cfg.smem_bytes())


# (device id, stream handle) -> the Hopper forward's counters on that stream.
_tile_counters: dict = {}


def _tile_counters_of(device_id: int, split_tiles: int):
    """The Hopper forward's int32 counters on the current stream: (ticket, tail).

    ticket: the CTAs draw work items past the first wave from it. tail: per
    split tile and consumer warpgroup, the key blocks whose partial outputs are
    written (cuda_src/tail_split.cuh), for at least `split_tiles` tiles. The
    kernel resets both to 0 (the last ticket's holder, each tile half's
    combiner), so they serve every launch on a stream (launches on one stream
    run in order; other streams get their own) and no call pays for an
    allocation and a memset.
    """
    cupy = _cupy()
    key = (device_id, cupy.cuda.get_current_stream().ptr)
    counters = _tile_counters.get(key)
    if counters is None or counters[1].size < 2 * split_tiles:
        buf = cupy.zeros(1 + 2 * max(split_tiles, sm_count(device_id)), dtype=cupy.int32)
        counters = _tile_counters[key] = (buf[:1], buf[1:])
    return counters


@functools.lru_cache(maxsize=1024)
def _sm90_kernel_spec(cfg, dtype_name: str, causal: bool, even_n: bool) -> tuple[str, int]:
    """The Hopper forward's name expression and dynamic shared memory (memoised: asked on every call)."""
    return cfg.name_expression(dtype_name, causal, even_n), cfg.smem_bytes(dtype_name)


def _launch_fwd_sm90(cfg, problem, q, k, v, out, lse, scale: float, descale) -> None:
    """The Hopper kernel: Q, K, V (fp8: Vt) reach it as tensor maps (cuflash/tma.py)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    q, k, v = (x if tma.usable(x) else aligned_copy(x) for x in (q, k, v))
    even_n = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
    name, smem = _sm90_kernel_spec(cfg, problem.dtype_name, problem.causal, even_n)
    kernel = _compile.get_kernel(cfg.family, name, smem)
    map_q = tma.seq_major_map(q, cfg.block_m)
    map_k = tma.seq_major_map(k, cfg.block_n)
    if problem.dtype_name == FP8_DTYPE_NAME:
        vt = fp8.transpose_v(v)
        map_v = tma.keys_major_map(vt, cfg.headdim)
        descale_q, descale_k, descale_v = descale
    else:
        map_v = tma.seq_major_map(v, cfg.block_n)
        descale_q = descale_k = descale_v = lse  # not read by 16-bit kernels
    # Each consumer warpgroup stores its 64 rows of a tile (out is 16-byte aligned: validate_output).
    map_o = tma.seq_major_map(out, cfg.block_m // 2) if cfg.stage_o else map_q  # map_q: not read
    o_strides = [numpy.int64(s) for s in _elem_strides(out)[:3]]
    num_tiles = (seqlen_q + cfg.block_m - 1) // cfg.block_m * nheads * batch
    ctas = sm_count(q.device.id) if cfg.persistent else num_tiles
    split = tail_split.TailSplit(num_tiles, 0)
    if cfg.persistent and not problem.causal and cfg.headdim < 256:  # TAIL_SPLIT in fwd_sm90.cuh
        split = tail_split.plan(num_tiles, ctas, (seqlen_k + cfg.block_n - 1) // cfg.block_n)
    grid = (min(split.full_tiles + split.items, ctas), 1, 1)
    ticket, tail_done = _tile_counters_of(q.device.id, split.split_tiles(num_tiles) if split.items else 0)
    ws_o = ws_lse = lse  # not read without a split
    if split.items:
        slots = split.slots(num_tiles)
        ws_o = _cupy().empty((slots, cfg.block_m, cfg.headdim), dtype=numpy.float32)
        ws_lse = _cupy().empty((slots, cfg.block_m), dtype=numpy.float32)
    # vt, the workspace and any contiguous copies are freed when this returns, before the
    # kernel has run: safe because CuPy's memory pool hands a freed block out
    # again only in stream order (to later work on this stream).
    args = (
        map_q,
        map_k,
        map_v,
        map_o,
        out,
        lse,
        descale_q,
        descale_k,
        descale_v,
        ticket,
        ws_o,
        ws_lse,
        tail_done,
        numpy.int32(split.full_tiles),
        numpy.int32(split.items),
        numpy.int32(seqlen_q),
        numpy.int32(seqlen_k),
        numpy.int32(headdim),
        numpy.int32(problem.group),
        numpy.int32(nheads),
        numpy.int32(k.shape[2]),
        numpy.int32(num_tiles),
        *o_strides,
        numpy.float32(scale * _LOG2E),
    )
    kernel(grid, (cfg.threads, 1, 1), args, shared_mem=smem)
