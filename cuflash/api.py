"""Public entry points: argument validation, layout normalisation, launch.

Layout follows flash-attn: q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_kv, headdim), any strides with a contiguous last dim.
"""

from __future__ import annotations

import functools
import math
import os

import numpy

from . import compile as _compile
from . import dispatch

try:  # CuPy holds bfloat16 arrays through ml_dtypes
    import ml_dtypes

    _BF16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _BF16 = None

_LOG2E = 1.4426950408889634
MAX_HEADDIM = 256
MIN_COMPUTE_CAPABILITY = 80
# cp.async moves 16-byte chunks: base pointers and the batch/seq/head strides
# must be multiples of 16 bytes (8 elements).
_ALIGN_ELEMS = 8


def _cupy():
    import cupy

    return cupy


def _dtype_name(dtype) -> str | None:
    if dtype == numpy.float16:
        return "float16"
    if _BF16 is not None and dtype == _BF16:
        return "bfloat16"
    return None


def _require_cupy_array(name: str, x) -> None:
    cupy = _cupy()
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")


def _require_device(device_id: int) -> None:
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
def compute_capability(device_id: int) -> int:
    """Compute capability of a device as major * 10 + minor (90 for H100/H200)."""
    return int(_cupy().cuda.Device(device_id).compute_capability)


def _elem_strides(x) -> tuple[int, ...]:
    # Dims of extent 1 are never stepped over: their stride is irrelevant.
    return tuple(0 if n == 1 else s // x.itemsize for n, s in zip(x.shape, x.strides))


def _last_dim_contiguous(x) -> bool:
    return x.shape[-1] == 1 or x.strides[-1] == x.itemsize


def _aligned(x) -> bool:
    if x.data.ptr % (_ALIGN_ELEMS * x.itemsize) != 0:
        return False
    return all(s % _ALIGN_ELEMS == 0 for s in _elem_strides(x)[:3])


def _validate_scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def _validate_qkv(q, k, v) -> str:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_cupy_array(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got shape {x.shape}")
    dtype_name = _dtype_name(q.dtype)
    if dtype_name is None:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
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


def validate_like(name: str, x, ref, ref_name: str) -> None:
    """x must be a CuPy array with ref's shape, dtype and device and a contiguous last dim."""
    _require_cupy_array(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {ref.shape}, got {x.shape}")
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on device {x.device.id}, {ref_name} on device {ref.device.id}")
    if not _last_dim_contiguous(x):
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.strides}")


def validate_output(name: str, x, ref, ref_name: str) -> None:
    """An output array the kernels write in place (never copied): validate_like plus alignment."""
    validate_like(name, x, ref, ref_name)
    if not _aligned(x):
        raise ValueError(f"{name} must be 16-byte aligned with batch/seq/head strides that are multiples of 8 elements")


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, tune=False):
    """Exact attention softmax(q k^T * softmax_scale) v, FlashAttention style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    cupy float16 or bfloat16, last dim contiguous. nheads must be a multiple of
    nheads_kv (GQA/MQA: query head h reads kv head h // (nheads // nheads_kv)).
    causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned);
    a row that sees no key gets output 0 and lse -inf.
    softmax_scale: defaults to 1 / sqrt(headdim).
    Returns out (q's shape and dtype); with return_lse=True, (out, lse) where lse
    is float32 (batch, nheads, seqlen_q), natural log.
    tune: first autotune this problem at this shape unless the tuning cache
    already holds it (as does the environment variable CUFLASH_AUTOTUNE=1).
    """
    dtype_name = _validate_qkv(q, k, v)
    scale = _validate_scale(softmax_scale, q.shape[3])
    if out is not None:
        validate_output("out", out, q, "q")
    causal = bool(causal)
    cupy = _cupy()
    _require_device(q.device.id)

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    with q.device:
        if out is None:
            out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
        if seqlen_q == 0 or batch == 0 or nheads == 0:
            return (out, lse) if return_lse else out
        if seqlen_k == 0:
            out.fill(0)
            lse.fill(-numpy.inf)
            return (out, lse) if return_lse else out
        q_, k_, v_ = (x if _aligned(x) else cupy.ascontiguousarray(x) for x in (q, k, v))

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
        if tune or os.environ.get("CUFLASH_AUTOTUNE", "0") not in ("", "0"):
            from .tuner import tune_call

            tune_call(problem, batch, nheads, nheads_kv)
        cfg, _ = dispatch.fwd_config(problem)
        launch_fwd(cfg, problem, q_, k_, v_, out, lse, scale)
    return (out, lse) if return_lse else out


def launch_fwd(cfg, problem, q, k, v, out, lse, scale: float) -> None:
    """Launch the forward kernel `cfg` on CuPy's current stream (arguments already validated)."""
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
