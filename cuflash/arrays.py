"""Facts about CuPy arrays that every layer asks: dtype names, element strides, 16-byte alignment.

Imports no other cuflash module but the fp8 dtype test and the lazy CuPy import.
"""

from __future__ import annotations

import numpy

from .config import FP8_DTYPE_NAME
from .device import cupy
from .fp8 import is_e4m3

try:  # CuPy holds bfloat16 arrays through ml_dtypes
    import ml_dtypes

    BF16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

# cp.async and TMA move 16-byte chunks: base pointers and the batch/seq/head
# strides must be multiples of 16 bytes.
ALIGN_BYTES = 16


def dtype_name(dtype) -> str | None:
    """"float16", "bfloat16" or the fp8 name for the dtypes cuflash computes in, else None."""
    if dtype == numpy.float16:
        return "float16"
    if BF16 is not None and dtype == BF16:
        return "bfloat16"
    if is_e4m3(dtype):
        return FP8_DTYPE_NAME
    return None


def numpy_dtype(name: str) -> numpy.dtype:
    """The array dtype of a 16-bit dtype name."""
    return numpy.dtype(numpy.float16) if name == "float16" else BF16


def out_dtype(dtype_name: str, in_dtype):
    """The output dtype: the input's, bfloat16 for fp8 inputs."""
    return BF16 if dtype_name == FP8_DTYPE_NAME else in_dtype


def elem_strides(x) -> tuple[int, ...]:
    """Strides in elements; dims of extent 1 are never stepped over, so theirs is 0."""
    return tuple(0 if n == 1 else s // x.itemsize for n, s in zip(x.shape, x.strides))


def contiguous_strides(shape) -> tuple[int, ...]:
    """elem_strides of a C-contiguous array of this shape (an aligned copy's)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(0 if n == 1 else step)
        step *= n
    return tuple(reversed(strides))


def last_dim_contiguous(x) -> bool:
    return x.shape[-1] == 1 or x.strides[-1] == x.itemsize


def is_aligned(x) -> bool:
    """Base pointer and batch/seq/head strides are multiples of 16 bytes (what the kernels' loads need)."""
    if x.data.ptr % ALIGN_BYTES != 0:
        return False
    return all(s * x.itemsize % ALIGN_BYTES == 0 for s in elem_strides(x)[:3])


def aligned_copy(x):
    """A C-contiguous copy of x in fresh memory (CuPy's pool aligns blocks to 256 bytes).

    cupy.ascontiguousarray would return a contiguous but misaligned x itself.
    """
    return x.copy(order="C")


def pool_array(shape, dtype, nbytes: int):
    """An uninitialised array of `nbytes` from CuPy's pool: an ndarray over cupy.cuda.alloc's block,
    ~0.5 us of host time less than cupy.empty (H100 host). A planned call's output, whose byte count
    the plan knows."""
    cp = cupy()
    return cp.ndarray(shape, dtype, cp.cuda.alloc(nbytes))
