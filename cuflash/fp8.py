"""fp8 (e4m3) attention inputs: dtype recognition, descale factors, and the
transposed V operand of the Hopper kernel (cuda_src/fp8_prep.cuh)."""

from __future__ import annotations

import numpy

from . import compile as _compile

try:
    import ml_dtypes

    _E4M3 = numpy.dtype(ml_dtypes.float8_e4m3fn)
except (ImportError, AttributeError):  # pragma: no cover - ml_dtypes is a dependency
    _E4M3 = None

# Vt's key padding: a multiple of the Hopper kernel's 64-key Vt panels, of the
# fp8 P fragments' 32-key groups and of the transpose kernel's 16-key chunks.
VT_KEY_PAD = _compile.cpp_int_constant("fp8_prep.cuh", "VT_KEY_PAD")
# Keys and head-dim columns per CTA of the transpose kernel (fp8_prep.cuh: VT_BLOCK_KEYS, VT_BLOCK_COLS).
VT_BLOCK_KEYS = 128
VT_BLOCK_COLS = 128
TRANSPOSE_V_KERNEL = "cuflash::fp8_transpose_v_kernel<false>"
TRANSPOSE_V_VARLEN_KERNEL = "cuflash::fp8_transpose_v_kernel<true>"


def is_e4m3(dtype) -> bool:
    """uint8 arrays hold e4m3 bits; an ml_dtypes float8_e4m3fn dtype is taken as well."""
    return dtype == numpy.uint8 or (_E4M3 is not None and dtype == _E4M3)


def check_descale(name: str, x, batch: int, nheads_kv: int, device) -> None:
    """A descale factor: a float32 CuPy array of shape (batch, nheads_kv) on `device`."""
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    if x.shape != (batch, nheads_kv):
        raise ValueError(f"{name} must have shape (batch, nheads_kv) = {(batch, nheads_kv)}, got {x.shape}")
    if x.dtype != numpy.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device.id}")


def refuse_descales(q_descale, k_descale, v_descale) -> None:
    """Descales with inputs that are not fp8 raise, naming the first one given."""
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if x is not None:
            raise ValueError(f"{name} applies to fp8 (e4m3) inputs only")


def refuse_options(alibi_slopes, dropout: bool) -> None:
    """What the fp8 kernels lack raises: they take causal, window_size and softcap, not ALiBi or dropout."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: fp8 attention takes window_size and softcap, not ALiBi")
    if dropout:
        raise ValueError("dropout_p: fp8 attention takes no dropout")


def validate_descales(q_descale, k_descale, v_descale, batch: int, nheads_kv: int, fp8: bool, device):
    """The three descale factors as float32 (batch, nheads_kv) arrays on `device` (ones where None).

    Their values are not read here (that would wait for the GPU): they must be
    positive and finite, as dequantisation scales are.
    """
    import cupy

    if not fp8:
        refuse_descales(q_descale, k_descale, v_descale)
        return None
    out = []
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            with device:
                out.append(cupy.ones((batch, nheads_kv), dtype=cupy.float32))
            continue
        check_descale(name, x, batch, nheads_kv, device)
        out.append(cupy.ascontiguousarray(x))
    return tuple(out)


def transpose_v(v, mods=None, cu_seqlens=None, seqlen_k=None):
    """Vt (batch, nheads_kv, headdim, keys padded to VT_KEY_PAD) uint8, keys permuted per 32 (fp8_prep.cuh).

    v: (batch, seqlen_k, nheads_kv, headdim) e4m3 bits, headdim a multiple of 16, base pointer and
    batch/seq/head strides multiples of 16 bytes (tma.usable). Varlen (mods.varlen, v a (1, total_k,
    ...) view): Vt is (1, nheads_kv, headdim, total padded per sequence), each sequence's keys from a
    multiple of VT_KEY_PAD; cu_seqlens: (cu_seqlens_q, cu_seqlens_k) on the device, seqlen_k the longest.
    """
    import cupy

    batch, keys, nheads_kv, headdim = v.shape
    varlen = mods is not None and mods.varlen is not None
    if varlen:  # no sequence is longer than the packed keys, whatever max_seqlen_k says
        batch, keys = mods.varlen.num_seqs, min(seqlen_k, max(1, mods.varlen.total_k))
        nk_pad = -(-mods.varlen.total_k // VT_KEY_PAD) * VT_KEY_PAD + batch * VT_KEY_PAD
        # Zeros between the sequences' areas: a key block past a sequence's end reads them with P = 0,
        # and 0 * NaN (uninitialised bits) would be NaN.
        vt = cupy.zeros((1, nheads_kv, headdim, nk_pad), dtype=cupy.uint8)
        offsets = (cu_seqlens[1], numpy.int32(mods.varlen.total_k))
        pad_grid = -(-keys // VT_KEY_PAD) * VT_KEY_PAD
    else:
        nk_pad = -(-keys // VT_KEY_PAD) * VT_KEY_PAD
        vt = cupy.empty((batch, nheads_kv, headdim, nk_pad), dtype=cupy.uint8)
        offsets = (numpy.uint64(0), numpy.int32(0))
        pad_grid = nk_pad
    kernel = _compile.get_kernel("fp8_prep", TRANSPOSE_V_VARLEN_KERNEL if varlen else TRANSPOSE_V_KERNEL, 0)
    # bytes = elements; a dim of extent 1 is never stepped over (varlen's batch: stride 0)
    strides = [numpy.int64(0 if n == 1 else s) for n, s in zip(v.shape[:3], v.strides[:3])]
    grid = (batch * nheads_kv, -(-pad_grid // VT_BLOCK_KEYS), -(-headdim // VT_BLOCK_COLS))
    kernel(grid, (256, 1, 1), (v.view(cupy.uint8), vt, numpy.int32(keys), numpy.int32(nk_pad),
                               numpy.int32(headdim), numpy.int32(nheads_kv), *strides, *offsets))
    return vt


def _e4m3_table():
    """Positive e4m3 values (codes 0..126, increasing) and the midpoints between them."""
    import ml_dtypes

    values = numpy.arange(127, dtype=numpy.uint8).view(ml_dtypes.float8_e4m3fn).astype(numpy.float32)
    return values, (values[1:] + values[:-1]) / 2


def quantize_e4m3(x):
    """A float CuPy array (batch, seqlen, heads, headdim) as fp8 attention inputs.

    Returns (e4m3 bits as uint8, float32 descale of shape (batch, heads)):
    one scale per (batch, head), the head's largest magnitude mapped to 448
    (e4m3's largest finite value), values rounded to the nearest e4m3 (exact
    ties towards zero). attention() takes descales per kv head: under GQA,
    quantise q with its heads grouped per kv head, e.g. through
    q.reshape(batch, seqlen, nheads_kv, -1).
    """
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"x must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    if x.ndim != 4 or x.shape[1] == 0 or x.shape[3] == 0:
        raise ValueError(f"x must have shape (batch, seqlen, heads, headdim) with seqlen and headdim >= 1, "
                         f"got {x.shape}")
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"x must be a float array, got {x.dtype}")
    _, midpoints = _e4m3_table()
    amax = cupy.abs(x).max(axis=(1, 3))
    descale = cupy.where(amax > 0, amax / 448.0, 1.0).astype(cupy.float32)
    y = x / descale[:, None, :, None]
    code = cupy.searchsorted(cupy.asarray(midpoints), cupy.abs(y)).astype(cupy.uint8)
    return code | (cupy.signbit(y).astype(cupy.uint8) << 7), descale


def dequantize_e4m3(bits, descale):
    """float64 values of quantize_e4m3's output."""
    import cupy

    values, _ = _e4m3_table()
    table = cupy.asarray(numpy.concatenate([values, [numpy.nan], -values, [numpy.nan]]))
    return table[bits].astype(cupy.float64) * descale[:, None, :, None].astype(cupy.float64)
