"""`attention`: the forward entry point.

Layout follows flash-attn: q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_kv, headdim), any strides with a contiguous last dim.

A call validates its arguments (cuflash.validate), asks dispatch for a kernel
configuration, and runs a prepared launch (cuflash.launch). The prepared
launch is kept as the call's plan, keyed by everything validation and
dispatch read; a later call with the same key skips both.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy

from . import dispatch, fp8, launch, tuner, validate
from .arrays import ALIGN_BYTES, aligned_copy, is_aligned, out_dtype, pool_array
from .config import FP8_DTYPE_NAME
from .device import compute_capability, cupy, max_smem_per_block
from .plans import PlanCache, ndarray_type, option_key, optional_layout

# Environment variable that turns autotuning on for every call.
AUTOTUNE_ENV = "CUFLASH_AUTOTUNE"


def autotune_requested(tune: bool) -> bool:
    return tune or os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0")


def attention(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None,
              return_lse=False, out=None, lse=None, tune=False, q_descale=None, k_descale=None, v_descale=None,
              dropout_p=0.0, seed=0, offset=0):
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
    window_size: (left, right), -1 unbounded: query i sees keys j with
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
    (with causal, right = 0). Key blocks outside every row's window are skipped.
    softcap: > 0 replaces each scaled score s by softcap * tanh(s / softcap).
    alibi_slopes: float32 (nheads,) or (batch, nheads): adds -slope * |i + seqlen_k - seqlen_q - j|
    to the (softcapped) scaled score. fp8 takes window_size and softcap, not alibi_slopes.
    softmax_scale: defaults to 1 / sqrt(headdim).
    dropout_p, seed, offset: dropout on the attention probabilities, out = (P o M / (1 - p)) v,
    the keep mask M a pure function of (seed, offset) and the position (b, h, i, j)
    (`cuflash.reference.dropout_keep_mask` gives it); lse stays the undropped softmax's. The
    backward takes the same three to regenerate M. 16-bit inputs, every 16-bit kernel family.
    seed may instead be a device uint32 array of 4 words (seed low, seed high, offset low,
    offset high; offset then 0) that the kernels read: a framework's random state or a CUDA
    graph replay can then change the mask without the host.
    out, lse: optional arrays to write (q's shape, the output dtype, 16-byte
    aligned; float32 (batch, nheads, seqlen_q), C-contiguous). With both given
    the call allocates nothing, so it can be captured in a CUDA graph.
    Returns out; with return_lse=True, (out, lse), lse in natural log.
    tune: first autotune this problem at this shape unless the tuning cache
    already holds it (as does the environment variable CUFLASH_AUTOTUNE=1;
    windows, softcap and ALiBi are tuned under keys of their own; fp8,
    dropout and varlen calls run the heuristic's kernel).
    """
    key = None
    descales = (q_descale, k_descale, v_descale)
    if not tune and not dropout_p:  # dropout calls take the full path (seed and offset change per call)
        key = _plan_key(q, k, v, causal, window_size, softcap, alibi_slopes, softmax_scale, out, lse, descales)
        plan = _plans.get(key) if key is not None else None
        if plan is not None:
            return plan.call(q, k, v, out, lse, return_lse, descales, alibi_slopes)
    dtype_name = validate.qkv(q, k, v, allow_fp8=True)
    is_fp8 = dtype_name == FP8_DTYPE_NAME
    scale = validate.softmax_scale(softmax_scale, q.shape[3])
    if is_fp8:
        fp8.refuse_options(alibi_slopes, dropout=bool(dropout_p))
    causal, mods = validate.score_options(q, k, causal, window_size, softcap, alibi_slopes, dropout_p, seed, offset)
    result_dtype = out_dtype(dtype_name, q.dtype)
    if out is not None:
        validate.output("out", out, q, "q", result_dtype)
    if lse is not None:
        validate.lse_array("lse", lse, q, writable=True)
    validate.disjoint({"out": out, "lse": lse}, {"q": q, "k": k, "v": v})
    device_id = validate.cuda_device(q, fp8=is_fp8)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    descale = fp8.validate_descales(q_descale, k_descale, v_descale, batch, nheads_kv, is_fp8, q.device)
    cp = cupy()
    with q.device:
        if out is None or lse is None:
            launch.require_not_capturing("attention without out= and lse=")
            out, lse = _outputs(q.shape, result_dtype, (batch, nheads, seqlen_q), out, lse)
        if out.size == 0:
            return (out, lse) if return_lse else out
        if seqlen_k == 0:
            out.fill(0)
            lse.fill(-numpy.inf)
            return (out, lse) if return_lse else out
        copies = tuple(not is_aligned(x) for x in (q, k, v))
        q_, k_, v_ = (aligned_copy(x) if copy else x for x, copy in zip((q, k, v), copies))
        problem = dispatch.FwdProblem(dtype_name, headdim, causal, seqlen_q, seqlen_k, nheads // nheads_kv,
                                      max_smem_per_block(device_id), compute_capability(device_id), mods)
        autotune = autotune_requested(tune) and mods.tuned  # varlen and dropout are not tuned
        if not is_fp8 and autotune:
            tuner.tune_call(problem, batch, nheads, nheads_kv)
        cfg, _ = dispatch.fwd_config(problem)
        prepared = launch.prepare_fwd(cfg, problem, q_, k_, v_, out, lse, scale, device_id)
        prepared.run(q_, k_, v_, out, lse, cp.cuda.get_current_stream().ptr, descale, alibi_slopes)
    if key is not None and not autotune:  # under autotuning every call may tune (dropout: no key)
        _plans.store(key, _Plan(prepared, copies, result_dtype, out.nbytes, device_id, lse.shape, lse.size, descale))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- repeated calls
# See cuflash/plans.py. A plan hit costs ~10 us of host time against ~40 us
# for the full path (H100 machine).
_plans = PlanCache()


@dataclasses.dataclass(frozen=True)
class _Plan:
    launch: object  # launch.FwdSm80Launch | launch.FwdSm90Launch
    copies: tuple  # whether q, k, v go to the kernel as aligned copies
    out_dtype: numpy.dtype
    out_bytes: int
    device_id: int
    lse_shape: tuple
    lse_size: int
    # fp8: the first call's descales; a later call's given ones replace them (ones stand for None)
    descale: tuple | None
    # stream handle -> the stream's scratch for an unwanted lse (launch.StreamState), looked up once
    discarded_lse: dict = dataclasses.field(default_factory=dict)

    def call(self, q, k, v, out, lse, return_lse: bool, descales: tuple, slopes):
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with q.device:
                return self.call(q, k, v, out, lse, return_lse, descales, slopes)
        stream = cp.cuda.get_current_stream()
        kernel_lse = lse
        if out is None or lse is None:
            launch.require_not_capturing("attention without out= and lse=", stream)
            if lse is None and not return_lse:
                # The kernel writes every row's lse: where the caller wants none, into the
                # stream's scratch, so that the call allocates only its output.
                kernel_lse = self.discarded_lse.get(stream.ptr)
                if kernel_lse is None:
                    kernel_lse = launch.stream_state(self.device_id, stream.ptr).discarded_lse_for(self.lse_size)
                    self.discarded_lse[stream.ptr] = kernel_lse
                out = pool_array(q.shape, self.out_dtype, self.out_bytes) if out is None else out
            else:
                out, lse = _outputs(q.shape, self.out_dtype, self.lse_shape, out, lse)
                kernel_lse = lse
        copies = self.copies
        if copies[0] or copies[1] or copies[2]:
            q, k, v = (aligned_copy(x) if copy else x for x, copy in zip((q, k, v), copies))
        descale = self.descale
        if descale is not None:
            descale = tuple(given if given is not None else first for given, first in zip(descales, descale))
        self.launch.run(q, k, v, out, kernel_lse, stream.ptr, descale, slopes)
        return (out, lse) if return_lse else out


# Byte offset of lse behind out in their shared allocation (CuPy's pool rounds blocks to 512).
_LSE_ALIGN = 512


def _outputs(out_shape, out_dtype, lse_shape, out, lse):
    """out and lse where not given, the two in one allocation (one pool call instead of two: ~3 us
    of host time; lse is 1/32 of out's bytes at head dim 64, so keeping it alive with out costs little)."""
    cp = cupy()
    out_bytes = -(-math.prod(out_shape) * numpy.dtype(out_dtype).itemsize // _LSE_ALIGN) * _LSE_ALIGN
    lse_bytes = 4 * math.prod(lse_shape)
    memory = cp.cuda.alloc((out_bytes if out is None else 0) + (lse_bytes if lse is None else 0))
    if out is None:
        out = cp.ndarray(out_shape, out_dtype, memory)
        memory = memory + out_bytes
    if lse is None:
        lse = cp.ndarray(lse_shape, numpy.float32, memory)
    return out, lse


def _plan_key(q, k, v, causal, window_size, softcap, alibi_slopes, softmax_scale, out, lse, descales):
    """The plan key of a call with these arguments, or None where only the full path applies."""
    ndarray = ndarray_type()
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    options = option_key(window_size, softcap, softmax_scale)
    if options is None or type(causal) is not bool:
        return None
    q_descale, k_descale, v_descale = descales
    if (out is None and lse is None and alibi_slopes is None and q_descale is None and k_descale is None
            and v_descale is None):
        outputs = None  # the common call: ~1 us less than the general form below
    else:
        try:
            outputs = (optional_layout(out), optional_layout(lse), optional_layout(alibi_slopes),
                       *(optional_layout(x) for x in descales))
        except LookupError:
            return None
        if any(x is not None and not x.flags.c_contiguous for x in descales):  # copied on the full path
            return None
    qd, kd, vd = q.data, k.data, v.data
    return (q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, q.dtype, k.dtype, v.dtype,
            qd.device_id, kd.device_id, vd.device_id, qd.ptr % ALIGN_BYTES, kd.ptr % ALIGN_BYTES,
            vd.ptr % ALIGN_BYTES, outputs, causal, options, dispatch.cache_state())

