"""`dropout_keep_mask`: the keep mask the kernels draw for dropout_p with (seed, offset), on the device.

The device twin of `cuflash.reference.dropout_keep_mask`, drawn by the kernels' own functions
(cuda_src/dropout_mask.cuh), for tests that check a call with dropout against a reference given
its mask (`cuflash.torch`'s return_attn_probs). One byte an element: for small problems.
"""

from __future__ import annotations

import numpy

from . import validate
from .compile import cpp_int_constant
from .device import cupy
from .kernel_call import KernelArgs, kernel
from .score_mods import Dropout

THREADS = cpp_int_constant("dropout_mask.cuh", "DROPOUT_MASK_THREADS")
KERNEL_NAME = "cuflash::dropout_mask_kernel"
UNITS_PER_TILE = 32  # a 16 x 16 tile's units of eight elements (cuda_src/dropout.cuh)


def dropout_keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """bool (batch, nheads, seqlen_q, seqlen_k) CuPy array on the current device, True where element
    (b, h, i, j) is kept by a call with dropout_p, seed and offset (ints in [0, 2**64)). Under varlen,
    sequence b's mask is [b, :, :its seqlen_q, :its seqlen_k] (its own positions)."""
    prob, seed, offset = validate.dropout(dropout_p, seed, offset)
    if prob == 0:
        raise ValueError("dropout_p must be in (0, 1) for a keep mask, got 0")
    if isinstance(seed, cupy().ndarray):
        raise TypeError("seed must be an int here (a device seed array has no host value to draw from)")
    sizes = dict(batch=batch, nheads=nheads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    for name, value in sizes.items():
        if not validate.is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    keep = cupy().empty((batch, nheads, seqlen_q, seqlen_k), numpy.bool_)
    units = batch * nheads * -(-seqlen_q // 16) * -(-seqlen_k // 16) * UNITS_PER_TILE
    if units == 0:
        return keep
    device_id = cupy().cuda.Device().id
    dropout = Dropout(prob, seed, offset)
    args = KernelArgs([keep, numpy.int64(units), numpy.int32(seqlen_q), numpy.int32(seqlen_k),
                       *(numpy.uint32(word) for word in dropout.philox_words), numpy.uint32(dropout.threshold)])
    kernel("dropout_mask", KERNEL_NAME, 0, device_id).launch((-(-units // THREADS), 1, 1), THREADS, args,
                                                             cupy().cuda.get_current_stream().ptr)
    return keep
