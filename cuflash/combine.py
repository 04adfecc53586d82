"""`combine_partials`: exact attention from partial results over disjoint key sets.

Attention over keys K = K_1 + ... + K_S is the merge of the attentions over
each K_s by their logsumexps (cuda_src/combine.cuh): what split-KV decoding
does between its two launches, and what ring attention and cascade inference
do across steps.
"""

from __future__ import annotations

import numpy

from . import validate
from .arrays import elem_strides, last_dim_contiguous
from .decode_launch import CombineLaunch
from .device import cupy

OUT_DTYPES = ("float32", "float16", "bfloat16")


def combine_partials(out_partials, lse_partials, *, out_dtype=None, out=None, return_lse=False, lse=None):
    """Merge S partial attention results of the same queries into one.

    out_partials: float32 (S, batch, seqlen, nheads, headdim), each part's normalised output,
    last dim contiguous with a 16-byte aligned row start.
    lse_partials: float32 (S, batch, nheads, seqlen), each part's logsumexp (natural log;
    -inf for a part with no key), any strides.
    out_dtype: float32 (default), float16 or bfloat16; out: an output array to write instead.
    Returns out (batch, seqlen, nheads, headdim), with return_lse also the merged
    lse (batch, nheads, seqlen), float32; lse= gives an array to write it to.
    """
    cp = cupy()
    for name, x in (("out_partials", out_partials), ("lse_partials", lse_partials)):
        validate.require_cupy_array(name, x)
        if x.dtype != numpy.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    if out_partials.ndim != 5 or out_partials.shape[0] == 0:
        raise ValueError(f"out_partials must have shape (S, batch, seqlen, nheads, headdim) with S >= 1, "
                         f"got {out_partials.shape}")
    splits, batch, seqlen, nheads, headdim = out_partials.shape
    expected = (splits, batch, nheads, seqlen)
    if lse_partials.shape != expected:
        raise ValueError(f"lse_partials must have shape (S, batch, nheads, seqlen) = {expected}, "
                         f"got {lse_partials.shape}")
    validate.same_device("lse_partials", lse_partials, out_partials, "out_partials")
    if headdim % 4 != 0 or not last_dim_contiguous(out_partials) or out_partials.data.ptr % 16 or any(
            s % 4 for s in elem_strides(out_partials)[:4]):
        raise ValueError("out_partials must have a head dim that is a multiple of 4, contiguous, with rows "
                         f"starting on 16-byte boundaries; got shape {out_partials.shape}, strides "
                         f"{out_partials.strides}")
    if out is not None:
        validate.require_cupy_array("out", out)
        dtype_name = numpy.dtype(out.dtype).name
        if out.shape != out_partials.shape[1:]:
            raise ValueError(f"out must have shape {out_partials.shape[1:]}, got {out.shape}")
    else:
        dtype_name = "float32" if out_dtype is None else numpy.dtype(out_dtype).name
    if dtype_name not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype_name}")
    device_id = validate.cuda_device(out_partials)
    with out_partials.device:
        if out is None:
            out = cp.empty(out_partials.shape[1:], dtype_name)
        elif (out.device != out_partials.device or not last_dim_contiguous(out)
              or out.data.ptr % 8 or any(s * out.itemsize % 8 for s in elem_strides(out)[:3])):
            raise ValueError("out must be on out_partials' device, contiguous in its last dim, with rows "
                             "starting on 8-byte boundaries")
        if lse is not None:
            validate.require_cupy_array("lse", lse)
            if lse.shape != expected[1:] or lse.dtype != numpy.float32 or lse.device != out_partials.device:
                raise ValueError(f"lse must be float32 of shape {expected[1:]} on out_partials' device")
        elif return_lse:
            lse = cp.empty(expected[1:], numpy.float32)
        if out.size:
            pl = elem_strides(lse_partials)
            launch = CombineLaunch(dtype_name, splits, batch, seqlen, nheads, headdim,
                                   elem_strides(out_partials)[:4], (pl[0], pl[1], pl[3], pl[2]),
                                   elem_strides(out)[:3],
                                   (0, 0, 0) if lse is None else (elem_strides(lse)[0], elem_strides(lse)[2],
                                                                  elem_strides(lse)[1]),
                                   device_id)
            launch.run(out_partials.data.ptr, lse_partials.data.ptr, out.data.ptr,
                       0 if lse is None else lse.data.ptr, cp.cuda.get_current_stream().ptr)
    return (out, lse) if return_lse or lse is not None else out
