"""Argument validation and normalisation shared by every public entry point.

The face of the package: `attention`, `attention_backward` and every later
entry point check their arguments here, by these public names, before any
kernel is chosen. Each error names the argument and what was expected.
"""

from __future__ import annotations

import math

import numpy

from . import device, score_mods
# The face's checks of these options, shared with the tuner and the benchmark.
from .score_mods import dropout_probability, softcap, window_size
from .arrays import ALIGN_BYTES, dtype_name, is_aligned, last_dim_contiguous
from .config import FP8_DTYPE_NAME

MAX_HEADDIM = 256
HEADDIM_MULTIPLE = 8  # 16-byte rows of 16-bit elements
# Grid dims y and z carry heads and batch in the sm_80 kernels.
MAX_GRID_YZ = 65535
# Rows and positions the kernels count in int32 (lengths, offsets, cache positions) stay below this.
INT32_ROWS = 2**31


def require_cupy_array(name: str, x) -> None:
    if not isinstance(x, device.cupy().ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")


def flag(name: str, value) -> bool:
    """A call's on/off option: a bool, numpy.bool_, or the int 0 or 1 (bool() would read the string
    "False" as True)."""
    if value is True or value is False:
        return value
    if isinstance(value, numpy.bool_) or (is_int(value) and int(value) in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def integer(name: str, value) -> int:
    """An int argument (NumPy ints too; not a bool, a float or a string, which int() would convert)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def softmax_scale(value, headdim: int) -> float:
    """The scale of a call: 1/sqrt(headdim) for None, else `given_scale`'s."""
    return 1.0 / math.sqrt(headdim) if value is None else given_scale(value)


def given_scale(value) -> float:
    """A softmax_scale given: a positive number up to score_mods.MAX_FACTOR (the kernels multiply scores
    by it in float32)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(value).__name__}")
    scale = float(value)
    if not 0 < scale <= score_mods.MAX_FACTOR:  # also rejects NaN
        raise ValueError(f"softmax_scale must be a positive number up to 2^{score_mods.MAX_FACTOR_LOG2}, "
                         f"got {value!r}")
    return scale


def alibi_slopes(x, batch: int, nheads: int) -> int | None:
    """The batch stride, in elements, of valid ALiBi slopes (0 for shape (nheads,)); None for None.

    x: a CuPy float32 array of shape (nheads,) or (batch, nheads), contiguous in its last dim.
    """
    if x is None:
        return None
    require_cupy_array("alibi_slopes", x)
    if x.dtype != numpy.float32:
        raise TypeError(f"alibi_slopes must be float32, got {x.dtype}")
    if x.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                         f"{(batch, nheads)}, got {x.shape}")
    if nheads > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"alibi_slopes must be contiguous in its last dim (nheads), got strides {x.strides}")
    return 0 if x.ndim == 1 else x.strides[0] // x.itemsize


def score_options(q, k, causal, window, cap, slopes, dropout_p=0.0, seed=0, offset=0):
    """(causal, ScoreMods) of a call on validated q and k with these window_size, softcap,
    alibi_slopes and dropout arguments: each checked, then normalised (cuflash.score_mods.normalise)."""
    causal = flag("causal", causal)
    window = window_size(window, causal)
    cap = softcap(cap)
    slopes_stride = alibi_slopes(slopes, q.shape[0], q.shape[2])
    if slopes is not None:
        same_device("alibi_slopes", slopes, q)
    return score_mods.normalise(causal, window, cap, slopes_stride, q.shape[1], k.shape[1],
                                dropout=dropout_option(dropout_p, seed, offset, q))


def dropout_option(p, seed, offset, q):
    """The call's score_mods.Dropout, None for dropout_p = 0 (after `dropout`'s checks; a seed
    given as a device array must be on q's device)."""
    prob, seed, offset = dropout(p, seed, offset)
    if prob == 0:
        return None
    if isinstance(seed, int):
        return score_mods.Dropout(prob, seed, offset)
    same_device("seed", seed, q)
    return score_mods.Dropout(prob, 0, 0, state=seed.data.ptr)


def qkv(q, k, v, allow_fp8: bool = False) -> str:
    """The dtype name of valid q, k, v (fp8 only where allow_fp8: the forward)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_cupy_array(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got shape {x.shape}")
    name_of_dtype = dtype_name(q.dtype)
    if name_of_dtype == FP8_DTYPE_NAME and not allow_fp8:
        raise TypeError(f"q must be float16 or bfloat16 (fp8 attention is forward-only), got {q.dtype}")
    if name_of_dtype is None:
        raise TypeError(f"q must be float16, bfloat16 or fp8 e4m3 (uint8 bits), got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    batch, _, nheads, headdim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have q's batch size {batch}, got shape {k.shape}")
    head_shapes(q.shape, k.shape, v.shape)
    check_headdim(headdim)
    if name_of_dtype == FP8_DTYPE_NAME and headdim % 16 != 0:
        raise ValueError(f"q: fp8 head dim must be a multiple of 16 (16-byte rows), got {headdim}")
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"q: batch and nheads must each be at most {MAX_GRID_YZ}, got shape {q.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not last_dim_contiguous(x):
            raise ValueError(f"{name} must be contiguous in its last dim (headdim), got strides {x.strides}")
    for name, x in (("k", k), ("v", v)):
        same_device(name, x, q)
    return name_of_dtype


def head_shapes(q_shape, k_shape, v_shape) -> None:
    """The heads of q, k, v (their last two dims, so packed 3-dim shapes and traced ones take it too):
    v of k's shape, k of q's head dim, q's nheads a multiple of k's nheads_kv >= 1."""
    nheads, headdim = q_shape[-2:]
    if k_shape[-1] != headdim:
        raise ValueError(f"k must have q's head dim {headdim}, got shape {k_shape}")
    if v_shape != k_shape:
        raise ValueError(f"v must have k's shape {k_shape}, got {v_shape}")
    nheads_kv = k_shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k's nheads_kv ({nheads_kv})")


def like(name: str, x, ref, ref_name: str, dtype=None) -> None:
    """x must be a CuPy array with ref's shape, dtype (or `dtype`) and device and a contiguous last dim."""
    require_cupy_array(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {ref.shape}, got {x.shape}")
    if dtype is not None:
        if x.dtype != dtype:
            raise TypeError(f"{name} must be {numpy.dtype(dtype).name}, got {x.dtype}")
    elif x.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {x.dtype}")
    beside(name, x, ref, ref_name)


def companion(name: str, x, q) -> None:
    """x, an array a kernel reads beside q: q's dtype and device, contiguous in its last dim (headdim)."""
    if x.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    beside(name, x, q)


def same_device(name: str, x, ref, ref_name: str = "q") -> None:
    """x (a CuPy array) on ref's device."""
    if x.device != ref.device:
        raise ValueError(f"{name} is on device {x.device.id}, {ref_name} on device {ref.device.id}")


def beside(name: str, x, ref, ref_name: str = "q") -> None:
    """x on ref's device and contiguous in its last dim."""
    same_device(name, x, ref, ref_name)
    if not last_dim_contiguous(x):
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.strides}")


def check_headdim(headdim: int) -> None:
    """q's head dim: a multiple of HEADDIM_MULTIPLE up to MAX_HEADDIM."""
    if headdim % HEADDIM_MULTIPLE != 0 or not HEADDIM_MULTIPLE <= headdim <= MAX_HEADDIM:
        raise ValueError(f"q: head dim must be a multiple of {HEADDIM_MULTIPLE} between {HEADDIM_MULTIPLE} and "
                         f"{MAX_HEADDIM}, got {headdim}")


def output(name: str, x, ref, ref_name: str, dtype=None) -> None:
    """An output array the kernels write in place (never copied): `like` plus alignment, and positive
    strides (a zero stride writes one element many times, the Hopper kernels' tensor maps take no
    negative one)."""
    like(name, x, ref, ref_name, dtype)
    if not is_aligned(x):
        raise ValueError(f"{name} must be 16-byte aligned with batch/seq/head strides that are multiples of 8 elements")
    if any(n > 1 and s <= 0 for n, s in zip(x.shape, x.strides)):
        raise ValueError(f"{name} must have positive strides (an output, written in place), got {x.strides}")


def _byte_span(x) -> tuple[int, int]:
    """[first, last) byte addresses that x's elements occupy."""
    first = last = x.data.ptr
    for n, s in zip(x.shape, x.strides):
        if n > 1:
            if s < 0:
                first += (n - 1) * s
            else:
                last += (n - 1) * s
    return first, last + x.itemsize


def shifted_copies_meet(shift: int, shape, strides, itemsize: int) -> bool:
    """Whether an array of this layout and the same layout `shift` bytes on share a byte: whether
    some difference of two element offsets, sum j_i strides_i with |j_i| < shape_i, lies within
    itemsize of the shift. Dim by dim from the largest stride, trying each j_i that leaves the
    rest within the smaller dims' reach (a few per dim)."""
    dims = sorted(((abs(s), n) for n, s in zip(shape, strides) if n > 1 and s != 0), reverse=True)

    def meet(rest: int, at: int) -> bool:
        if at == len(dims):
            return abs(rest) < itemsize
        stride, extent = dims[at]
        reach = sum((n - 1) * s for s, n in dims[at + 1:]) + itemsize - 1
        low = max(-(extent - 1), -((reach - rest) // stride))
        high = min(extent - 1, (rest + reach) // stride)
        return any(meet(rest - j * stride, at + 1) for j in range(low, high + 1))

    return meet(shift, 0)


def disjoint(outputs: dict, inputs: dict) -> None:
    """The outputs (name -> array, None skipped) share no element with each other or with the inputs:
    a kernel writing one would change what it, or a later kernel, reads. Arrays whose byte spans
    meet are compared exactly: by their offsets where they have one layout (packed views such as
    dq, dk, dv of one dqkv array interleave without sharing), else element by element on the
    device, where the stream is not capturing a CUDA graph."""
    named_outputs = [(name, x) for name, x in outputs.items() if x is not None and x.size]
    others = named_outputs + [(name, x) for name, x in inputs.items() if x is not None and x.size]
    for i, (name, x) in enumerate(named_outputs):
        first, last = _byte_span(x)
        for other, y in others[i + 1:]:
            y_first, y_last = _byte_span(y)
            if y_first >= last or first >= y_last:
                continue
            if x.shape == y.shape and x.strides == y.strides and x.itemsize == y.itemsize:
                if shifted_copies_meet(y.data.ptr - x.data.ptr, x.shape, x.strides, x.itemsize):
                    raise ValueError(f"{name} must not share memory with {other}")
                continue
            if device.stream_is_capturing():
                raise ValueError(f"{name}'s memory range meets {other}'s (checked element by element outside "
                                 "CUDA graph capture only)")
            if x.itemsize != y.itemsize or device.cupy().shares_memory(x, y):
                raise ValueError(f"{name} must not share memory with {other}")


def lse_array(name: str, x, q, *, writable: bool, varlen: bool = False) -> None:
    """A logsumexp array of q's call: float32 (batch, nheads, seqlen_q), varlen (nheads, total_q) for q
    of shape (total_q, nheads, headdim), on q's device, contiguous when the kernels write it."""
    require_cupy_array(name, x)
    if varlen:
        dims, expected = "(nheads, total_q)", (q.shape[1], q.shape[0])
    else:
        dims, expected = "(batch, nheads, seqlen_q)", (q.shape[0], q.shape[2], q.shape[1])
    if x.shape != expected:
        raise ValueError(f"{name} must have shape {dims} = {expected}, got {x.shape}")
    if x.dtype != numpy.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    same_device(name, x, q)
    if writable and not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (the kernels write it in place), got strides {x.strides}")


def cuda_device(q, *, fp8: bool = False) -> int:
    """q's device id, after checking cuflash runs there (fp8: a Hopper GPU)."""
    device_id = q.device.id
    device.require_device(device_id)
    if fp8 and device.compute_capability(device_id) != device.HOPPER:
        cc = device.compute_capability(device_id)
        raise RuntimeError(f"cuflash: fp8 attention needs a Hopper GPU (compute capability 9.0); device "
                           f"{device_id} has {cc // 10}.{cc % 10}")
    return device_id


def is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, numpy.integer))


def cu_seqlens(name: str, x, total: int | None, batch: int | None = None) -> int:
    """The batch size B of valid cumulative sequence lengths x (B + 1 offsets into a packed dim of `total` rows).

    x: an int32 array of shape (B + 1,), B >= 1 (and B == batch when batch is
    given), as a NumPy array or a CuPy array (contiguous, as kernels read
    it).  On the host its values are checked too: x[0] == 0, non-decreasing,
    x[-1] == total (where total is given).  A CuPy array's values are not read here (that would
    synchronise with the device): they are the caller's contract, or get
    checked on the host where the caller has them there.
    """
    on_host = isinstance(x, numpy.ndarray)
    if not on_host:
        if not isinstance(x, device.cupy().ndarray):
            raise TypeError(f"{name} must be an int32 numpy.ndarray or cupy.ndarray of shape (batch + 1,), "
                            f"got {type(x).__module__}.{type(x).__name__}")
    if x.dtype != numpy.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != 1 or x.shape[0] < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {x.shape}")
    count = x.shape[0] - 1
    if batch is not None and count != batch:
        raise ValueError(f"{name} must have shape (batch + 1,) = ({batch + 1},), got {x.shape}")
    if not on_host:
        if x.strides[0] != x.itemsize:
            raise ValueError(f"{name} must be contiguous, got strides {x.strides}")
        return count
    if x[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(x[0])}")
    steps = numpy.diff(x.astype(numpy.int64))
    if numpy.any(steps < 0):
        at = int(numpy.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing, got {int(x[at])} then {int(x[at + 1])} at index {at}")
    if total is not None and int(x[-1]) != total:
        raise ValueError(f"{name} must end at the total length {total}, got {int(x[-1])}")
    return count


def max_seqlen(name: str, value, lengths=None) -> int:
    """A valid max_seqlen: a positive int32, at least the longest of the sequences' host `lengths` if given."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    length = int(value)
    if not 0 < length < INT32_ROWS:
        raise ValueError(f"{name} must be a positive int below 2^31 (the kernels count rows in int32), got {length}")
    if lengths is not None:
        longest = int(lengths.max()) if lengths.size else 0
        if length < longest:
            raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {length}")
    return length


# attention_varlen's mask_alignment: where each sequence's causal mask and window diagonals start.
MASK_ALIGNMENTS = ("bottom_right", "top_left")


def mask_alignment(value) -> bool:
    """Whether a varlen call's masks align to each sequence's top-left corner (query i's diagonal key
    is i, as jax.nn's) rather than its bottom-right one (i + nk - nq, flash-attn's)."""
    if not isinstance(value, str) or value not in MASK_ALIGNMENTS:
        raise ValueError(f"mask_alignment must be one of {MASK_ALIGNMENTS}, got {value!r}")
    return value == "top_left"


def int32_vector(name: str, x, batch: int, upper=None) -> None:
    """Validate an optional int32 (batch,) array: NumPy, its values checked in [0, upper) (upper: one
    bound, one per element, or None for none), or CuPy, contiguous (its values the caller's contract)."""
    if x is None:
        return
    if not isinstance(x, (numpy.ndarray, device.cupy().ndarray)):
        raise TypeError(f"{name} must be an int32 numpy.ndarray or cupy.ndarray of shape (batch,), "
                        f"got {type(x).__module__}.{type(x).__name__}")
    if x.dtype != numpy.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {x.shape}")
    if isinstance(x, numpy.ndarray):
        bad = (x < 0) | ((x >= upper) if upper is not None else False)
        if numpy.any(bad):
            at = int(numpy.argmax(bad))
            bound = "inf" if upper is None else int(numpy.broadcast_to(upper, x.shape)[at])
            raise ValueError(f"{name}[{at}] = {int(x[at])} is out of range [0, {bound})")
    elif x.strides[0] != x.itemsize and batch > 1:
        raise ValueError(f"{name} must be contiguous, got strides {x.strides}")


def seqused(name: str, x, batch: int, spans=None):
    """Sequence lengths used within the spans of cu_seqlens (flash-attn 3's seqused_q, seqused_k):
    int32_vector's, each at most its span's length where the spans' lengths (host offsets' differences)
    are given. Returns a NumPy array's values as int64, else None (a CuPy array's: the kernels clamp
    them into the spans)."""
    int32_vector(name, x, batch, None if spans is None else spans + 1)
    return x.astype(numpy.int64) if isinstance(x, numpy.ndarray) else None


def dropout(p, seed, offset) -> tuple[float, object, int]:
    """(dropout_p, seed, offset) of a call: p a real in [0, 1), seed and offset ints in [0, 2**64),
    or seed a device array of the seed and offset as 4 uint32 words (score_mods.DROPOUT_STATE_WORDS),
    read by the kernels, with offset 0."""
    prob = dropout_probability(p)
    if isinstance(seed, device.cupy().ndarray):
        words = score_mods.DROPOUT_STATE_WORDS
        if seed.dtype != numpy.uint32 or seed.shape != (words,) or not seed.flags.c_contiguous:
            raise ValueError(f"seed given as an array must be {words} contiguous uint32 words (seed low, seed "
                             f"high, offset low, offset high), got {seed.dtype} {seed.shape}")
        if seed.data.ptr % ALIGN_BYTES:
            raise ValueError(f"seed given as an array must be {ALIGN_BYTES}-byte aligned, got address "
                             f"{seed.data.ptr:#x}")
        if not is_int(offset) or offset != 0:
            raise ValueError(f"offset must be 0 when seed is an array (the array holds the offset), got {offset!r}")
        return prob, seed, 0
    values = []
    for name, value in (("seed", seed), ("offset", offset)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int in [0, 2**64), got {type(value).__name__}")
        if not 0 <= int(value) < 2**64:
            raise ValueError(f"{name} must be in [0, 2**64), got {int(value)}")
        values.append(int(value))
    return prob, values[0], values[1]
