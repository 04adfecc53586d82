"""The benchmark's inputs: dtypes by name, random q, k, v and output gradients, byte sizes."""

from __future__ import annotations

import cupy
import numpy

GiB = 1 << 30
MiB = 1 << 20


def cupy_dtype(name: str) -> numpy.dtype:
    if name == "float16":
        return numpy.dtype(numpy.float16)
    if name == "bfloat16":
        # CuPy represents bfloat16 through the ml_dtypes NumPy extension.
        import ml_dtypes

        return numpy.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unsupported dtype {name!r}")


def random_qkv(batch, seqlen, heads, headdim, dtype, seed):
    """Three (B, N, H, D) arrays of standard-normal values (never zeros)."""
    rng = cupy.random.default_rng(seed)
    shape = (batch, seqlen, heads, headdim)
    return tuple(rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for _ in range(3))


def random_dout(batch, seqlen, heads, headdim, dtype, seed):
    """A (B, N, H, D) output gradient, standard normal, independent of ``random_qkv(..., seed)``."""
    rng = cupy.random.default_rng(1_000_003 + seed)
    return rng.standard_normal((batch, seqlen, heads, headdim), dtype=cupy.float32).astype(dtype)
