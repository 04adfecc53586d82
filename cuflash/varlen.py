"""`attention_varlen`, `attention_varlen_backward`, `attention_varlen_vjp`: packed batches of
sequences of different lengths, flash-attn's `flash_attn_varlen_func` layout.

q is (total_q, nheads, headdim) and k, v (total_k, nheads_kv, headdim): the
sequences one after another, sequence b at rows cu_seqlens_q[b] ..
cu_seqlens_q[b + 1] of q (and cu_seqlens_k of k, v). Each sequence is its own
attention, every option applied per sequence (causal and window diagonals
bottom-right aligned in each). The lse is (nheads, total_q).

The kernels are the ones of `attention` with the MOD_VARLEN bit: they read the
offsets on the device, and no tile spans two sequences (cuda_src/seq_span.cuh).
The arrays go to them as (1, total, heads, headdim) views, so that the
forward's and backward's launches serve both layouts. Calls with device
offsets keep launch plans as `attention`'s do (cuflash/plans.py); host
offsets, whose values each call checks, take the full path.
"""

from __future__ import annotations

import dataclasses

import numpy

from . import dispatch, fp8, kv_cache, launch, validate
from .arrays import aligned_copy, is_aligned, out_dtype
from .backward import gradient_outputs
from .config import FP8_DTYPE_NAME
from .device import compute_capability, cupy, max_smem_per_block
from .plans import PlanCache, layout, ndarray_type, option_key, optional_layout
from .score_mods import Varlen, normalise


def _require_3d(**arrays) -> None:
    for name, x in arrays.items():
        validate.require_cupy_array(name, x)
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims (total, nheads, headdim), got shape {x.shape}")


def _offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int | None, device,
             seqused_q=None, seqused_k=None):
    """(cu_seqlens_q, cu_seqlens_k) on q's device, after validation, and the sequence count; with
    seqused_q or seqused_k, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), an absent one None.

    Host (NumPy) arrays are checked value by value and copied to the device;
    device arrays are the caller's contract (reading them would synchronise):
    the kernels clamp every offset into the packed rows and every length to
    max_seqlen and its span, so wrong ones give wrong results, never an access outside q, k, v or out.
    With seqused, max_seqlen bounds the used lengths, not the spans.
    """
    num_seqs = validate.cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    validate.cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, num_seqs)
    for name, value, cu, used_name, used in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "seqused_q", seqused_q),
                                             ("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "seqused_k", seqused_k)):
        spans = numpy.diff(cu.astype(numpy.int64)) if isinstance(cu, numpy.ndarray) else None
        used_lengths = validate.seqused(used_name, used, num_seqs, spans)
        validate.max_seqlen(name, value, used_lengths if used is not None else spans)
    if num_seqs > validate.MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {validate.MAX_GRID_YZ} sequences, got {num_seqs}")
    cp = cupy()
    on_device = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k)):
        if isinstance(x, numpy.ndarray):
            launch.require_not_capturing(f"attention_varlen with a host {name}")
            with device:
                x = cp.asarray(x)
        elif x is not None and x.device != device:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {device.id}")
        on_device.append(x)
    return _call_offsets(*on_device), num_seqs


def _options(q, k, causal, window_size, softcap, alibi_slopes, max_seqlen_q, max_seqlen_k, num_seqs,
             dropout=(0.0, 0, 0), mask_alignment="bottom_right"):
    """(causal, ScoreMods) of a varlen call: the options normalised at the longest lengths; dropout:
    (p, seed, offset), the mask over each sequence's own positions with b its index."""
    top_left = validate.mask_alignment(mask_alignment)
    causal = validate.flag("causal", causal)
    window = validate.window_size(window_size, causal)
    cap = validate.softcap(softcap)
    slopes_stride = validate.alibi_slopes(alibi_slopes, num_seqs, q.shape[1])
    if alibi_slopes is not None:
        validate.same_device("alibi_slopes", alibi_slopes, q)
    return normalise(causal, window, cap, slopes_stride, max_seqlen_q, max_seqlen_k,
                     Varlen(num_seqs, q.shape[0], k.shape[0], top_left), validate.dropout_option(*dropout, q))


def _packed(*arrays):
    """(1, total, heads, headdim) views, the layout the launches read."""
    return tuple(None if x is None else x[None] for x in arrays)


def _aligned(*arrays):
    """The arrays' views as the kernels read them: aligned copies where needed (arrays.is_aligned)."""
    return tuple(x if is_aligned(x) else aligned_copy(x) for x in _packed(*arrays))


def _output(name: str, x, ref, ref_name: str, dtype=None) -> None:
    """An output the kernels write in place: validate.output of the packed views."""
    validate.like(name, x, ref, ref_name, dtype)
    validate.output(name, *_packed(x, ref), ref_name, dtype)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None, return_lse=False,
                     out=None, lse=None, q_descale=None, k_descale=None, v_descale=None, block_table=None,
                     dropout_p=0.0, seed=0, offset=0, seqused_q=None, seqused_k=None,
                     mask_alignment="bottom_right"):
    """Exact attention of a packed batch of sequences of different lengths.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim), cupy
    float16 or bfloat16, last dim contiguous; or fp8 e4m3 bits (Hopper) with
    descales of shape (batch, nheads_kv), per sequence, as `attention`'s. cu_seqlens_q, cu_seqlens_k: int32
    (batch + 1,) offsets of the sequences (empty sequences allowed), NumPy
    (checked, then copied to the device) or CuPy (used as they are: the
    caller guarantees 0 = cu[0] <= ... <= cu[batch] = total). max_seqlen_q,
    max_seqlen_k: at least the longest query and key sequence.
    causal, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads)),
    softmax_scale: as `attention`, per sequence.
    out, lse: optional arrays to write: q's shape and dtype (16-byte aligned),
    float32 (nheads, total_q) C-contiguous.
    block_table: int32 (batch, max_pages): k and v are then a paged KV cache (num_pages,
    page_size, nheads_kv, headdim) as `attention_with_kvcache` takes, sequence b's keys its
    first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions (chunked prefill; 16-bit, forward only).
    dropout_p, seed, offset: as `attention`'s, the mask over each sequence's own positions with b
    the sequence's index.
    seqused_q, seqused_k: int32 (batch,), NumPy (checked) or CuPy (clamped into the spans), flash-attn
    3's: sequence b is only the first seqused_q[b] query rows and seqused_k[b] keys of its spans in
    cu_seqlens (a padded batch: cu_seqlens at multiples of the padded length); max_seqlen then bounds
    the used lengths. Rows past the used ones are not written: out and lse arrays cuflash allocates
    hold 0 and -inf there, given ones keep their contents (but for a batch without any key, whose
    every row is then 0 and -inf).
    mask_alignment: "bottom_right" (flash-attn's: query i's diagonal key is i + nk - nq of the
    sequence's used lengths) or "top_left" (jax.nn's: i), for causal, window_size and ALiBi alike.
    Returns out; with return_lse=True, (out, lse).
    """
    if block_table is not None:
        if dropout_p:
            raise ValueError("dropout_p: the paged prefill takes no dropout")
        for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if x is not None:
                raise NotImplementedError(f"{name}: the paged prefill takes the cache lengths from cu_seqlens_k "
                                          "(pass None)")
        if validate.mask_alignment(mask_alignment):
            raise NotImplementedError("mask_alignment: the paged prefill aligns to the bottom right only")
        return _paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                      window_size, softcap, alibi_slopes, softmax_scale, return_lse, out, lse,
                      (q_descale, k_descale, v_descale))
    key = None
    # fp8, dropout and other spellings of mask_alignment: the full path
    if q_descale is None and k_descale is None and v_descale is None and not dropout_p and \
            type(mask_alignment) is str:
        key = _plan_key((q, k, v), (out, lse), (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), max_seqlen_q,
                        max_seqlen_k, causal, (window_size, softcap, alibi_slopes), softmax_scale, mask_alignment)
    plan = _fwd_plans.get(key) if key is not None else None
    if plan is not None:
        return plan.call(q, k, v, out, lse, return_lse, alibi_slopes,
                         _call_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    _require_3d(q=q, k=k, v=v)
    q4, k4, v4 = _packed(q, k, v)
    dtype_name = validate.qkv(q4, k4, v4, allow_fp8=True)
    is_fp8 = dtype_name == FP8_DTYPE_NAME
    if is_fp8:
        fp8.refuse_options(alibi_slopes, dropout=bool(dropout_p))
    scale = validate.softmax_scale(softmax_scale, q.shape[2])
    device_id = validate.cuda_device(q, fp8=is_fp8)
    total_q, nheads, headdim = q.shape
    total_k, nheads_kv = k.shape[:2]
    cu_seqlens, num_seqs = _offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k,
                                    q.device, seqused_q, seqused_k)
    causal, mods = _options(q, k, causal, window_size, softcap, alibi_slopes, max_seqlen_q, max_seqlen_k, num_seqs,
                            (dropout_p, seed, offset), mask_alignment)
    descale = fp8.validate_descales(q_descale, k_descale, v_descale, num_seqs, nheads_kv, is_fp8, q.device)
    result_dtype = out_dtype(dtype_name, q.dtype)
    if out is not None:
        _output("out", out, q, "q", result_dtype)
    if lse is not None:
        validate.lse_array("lse", lse, q, writable=True, varlen=True)
    validate.disjoint({"out": out, "lse": lse}, {"q": q, "k": k, "v": v})
    cp = cupy()
    with q.device:
        out, lse = _forward_outputs(q, out, lse, result_dtype, cu_seqlens)
        if total_q == 0:
            return (out, lse) if return_lse else out
        if total_k == 0:
            out.fill(0)
            lse.fill(-numpy.inf)
            return (out, lse) if return_lse else out
        q_, k_, v_ = _aligned(q, k, v)
        problem = dispatch.FwdProblem(dtype_name, headdim, causal, max_seqlen_q, max_seqlen_k, nheads // nheads_kv,
                                      max_smem_per_block(device_id), compute_capability(device_id), mods)
        cfg, _ = dispatch.fwd_config(problem)
        (out4,) = _packed(out)
        prepared = launch.prepare_fwd(cfg, problem, q_, k_, v_, out4, lse, scale, device_id)
        prepared.run(q_, k_, v_, out4, lse, cp.cuda.get_current_stream().ptr, descale, alibi_slopes, cu_seqlens)
    if key is not None and not is_fp8:
        _fwd_plans.store(key, _FwdPlan(prepared, device_id))
    return (out, lse) if return_lse else out


def _call_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> tuple:
    """The device arrays a launch points the kernels at (launch._option_addresses)."""
    if seqused_q is None and seqused_k is None:
        return cu_seqlens_q, cu_seqlens_k
    return cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k


def _used(offsets: tuple) -> tuple[bool, bool]:
    """Whether a call's offsets (_call_offsets') hold seqused_q and seqused_k."""
    return (False, False) if len(offsets) == 2 else (offsets[2] is not None, offsets[3] is not None)


def _forward_outputs(q, out, lse, dtype, offsets: tuple):
    """out and lse as given, the missing ones new arrays (never while the stream captures a CUDA graph);
    with seqused_q among the offsets, new ones start at what the rows past the used ones read, 0 and -inf."""
    if out is not None and lse is not None:
        return out, lse
    launch.require_not_capturing("attention_varlen without out= and lse=")
    cp = cupy()
    total_q, nheads = q.shape[:2]
    rows_unused = _used(offsets)[0]
    if out is None:
        out = cp.zeros(q.shape, dtype) if rows_unused else cp.empty(q.shape, dtype)
    if lse is None:
        lse = cp.full((nheads, total_q), -numpy.inf, numpy.float32) if rows_unused else \
            cp.empty((nheads, total_q), numpy.float32)
    return out, lse


def _paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
           window_size, softcap, alibi_slopes, softmax_scale, return_lse, out, lse, descales):
    """attention_varlen over a paged KV cache (cuflash.kv_cache.attention_paged_varlen); a repeated
    signature with device offsets takes its plan."""
    if any(x is not None for x in descales):
        raise ValueError("block_table: a paged cache takes float16 or bfloat16, not fp8 with descales")
    key = _plan_key((q, k_cache, v_cache, block_table), (out, lse), (cu_seqlens_q, cu_seqlens_k, None, None),
                    max_seqlen_q, max_seqlen_k, causal, (window_size, softcap, alibi_slopes), softmax_scale, "paged")
    plan = _fwd_plans.get(key) if key is not None else None
    if plan is not None:
        out, lse = plan.call(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, out, lse)
        return (out, lse) if return_lse else out
    _require_3d(q=q)
    validate.check_headdim(q.shape[-1])  # before `out`, whose alignment follows from it
    if isinstance(cu_seqlens_k, numpy.ndarray):  # the paged keys' count is the offsets' own last entry
        validate.cu_seqlens("cu_seqlens_k", cu_seqlens_k, None)
    host_lengths = numpy.diff(cu_seqlens_k) if isinstance(cu_seqlens_k, numpy.ndarray) else None
    total_k = int(cu_seqlens_k[-1]) if host_lengths is not None else None
    cu_seqlens, _ = _offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], total_k, q.device)
    if out is not None:
        _output("out", out, q, "q")
    if lse is not None:
        validate.lse_array("lse", lse, q, writable=True, varlen=True)
    validate.disjoint({"out": out, "lse": lse}, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    out, lse, plan = kv_cache.attention_paged_varlen(
        q, k_cache, v_cache, *cu_seqlens, max_seqlen_q, block_table, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, out=out, lse=lse,
        host_key_lengths=host_lengths)
    if key is not None and plan is not None:
        _fwd_plans.store(key, plan)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- repeated calls
_fwd_plans = PlanCache()
_bwd_plans = PlanCache()


def _plan_key(arrays, outputs, offsets, max_seqlen_q, max_seqlen_k, causal, mods, softmax_scale, extra=None):
    """The plan key of a call, or None where only the full path applies (host offsets, other spellings).
    arrays: the inputs; outputs: the optional outputs; offsets: (cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k), the last two optional; mods: (window_size, softcap, alibi_slopes) as given."""
    ndarray = ndarray_type()
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = offsets
    if any(type(x) is not ndarray for x in (*arrays, cu_seqlens_q, cu_seqlens_k)):
        return None
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int or type(causal) is not bool:
        return None
    window_size, softcap, alibi_slopes = mods
    options = option_key(window_size, softcap, softmax_scale)
    if options is None:
        return None
    try:
        optional = tuple(optional_layout(x) for x in (*outputs, alibi_slopes, seqused_q, seqused_k))
    except LookupError:
        return None
    return (tuple(layout(x) for x in arrays), layout(cu_seqlens_q), layout(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
            causal, options, optional, extra, dispatch.cache_state())


@dataclasses.dataclass(frozen=True)
class _FwdPlan:
    launch: object  # launch.FwdSm80Launch | launch.FwdSm90Launch
    device_id: int

    def call(self, q, k, v, out, lse, return_lse: bool, slopes, cu_seqlens):
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with q.device:
                return self.call(q, k, v, out, lse, return_lse, slopes, cu_seqlens)
        out, lse = _forward_outputs(q, out, lse, q.dtype, cu_seqlens)
        q_, k_, v_ = _aligned(q, k, v)
        (out4,) = _packed(out)
        self.launch.run(q_, k_, v_, out4, lse, cp.cuda.get_current_stream().ptr, None, slopes, cu_seqlens)
        return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None, dropout_p=0.0,
                              seed=0, offset=0, seqused_q=None, seqused_k=None, mask_alignment="bottom_right"):
    """Gradients (dq, dk, dv) of `attention_varlen` given dout = dL/d(out).

    out and lse are the forward's results (`attention_varlen(..., return_lse=True)`)
    with the same offsets and options (dropout's, seqused's and mask_alignment's too); deterministic,
    dq, dk, dv as `attention_backward`. Rows past seqused_q (dq) and seqused_k (dk, dv) are not
    written: arrays cuflash allocates hold 0 there, given ones keep their contents (but for a batch
    without any query or key, whose every gradient row is then 0).
    """
    key = None
    if not dropout_p and type(deterministic) is bool and type(mask_alignment) is str:
        key = _plan_key((dout, q, k, v, out, lse), (dq, dk, dv), (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),
                        max_seqlen_q, max_seqlen_k, causal, (window_size, softcap, alibi_slopes), softmax_scale,
                        (deterministic, mask_alignment))
    plan = _bwd_plans.get(key) if key is not None else None
    if plan is not None:
        return plan.call(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes,
                         _call_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    _require_3d(dout=dout, q=q, k=k, v=v, out=out)
    dtype_name = validate.qkv(*_packed(q, k, v))
    validate.like("dout", dout, q, "q")
    validate.like("out", out, q, "q")
    validate.lse_array("lse", lse, q, writable=False, varlen=True)
    for name, x, ref, ref_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if x is not None:
            _output(name, x, ref, ref_name)
    validate.disjoint({"dq": dq, "dk": dk, "dv": dv}, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    scale = validate.softmax_scale(softmax_scale, q.shape[2])
    device_id = validate.cuda_device(q)
    total_q, nheads, headdim = q.shape
    total_k, nheads_kv = k.shape[:2]
    cu_seqlens, num_seqs = _offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k,
                                    q.device, seqused_q, seqused_k)
    causal, mods = _options(q, k, causal, window_size, softcap, alibi_slopes, max_seqlen_q, max_seqlen_k, num_seqs,
                            (dropout_p, seed, offset), mask_alignment)
    cp = cupy()
    with q.device:
        dq, dk, dv = _gradient_outputs(q, k, v, dq, dk, dv, cu_seqlens)
        if total_q == 0 or total_k == 0:
            for g in (dq, dk, dv):
                g.fill(0)
            return dq, dk, dv
        q4, k4, v4, dout4, out4 = _aligned(q, k, v, dout, out)
        dq4, dk4, dv4 = _packed(dq, dk, dv)
        lse = lse if lse.flags.c_contiguous else cp.ascontiguousarray(lse)
        problem = dispatch.BwdProblem(dtype_name, headdim, causal, max_seqlen_q, max_seqlen_k, nheads // nheads_kv,
                                      validate.flag("deterministic", deterministic), max_smem_per_block(device_id),
                                      compute_capability(device_id), mods)
        cfg, _ = dispatch.bwd_config(problem)
        prepared = launch.prepare_bwd(cfg, problem, scale, q4, k4, v4, dout4, out4, lse, dq4, dk4, dv4, device_id)
        prepared.run(q4, k4, v4, dout4, out4, lse, dq4, dk4, dv4, cp.cuda.get_current_stream().ptr, None,
                     alibi_slopes, cu_seqlens)
    if key is not None:
        _bwd_plans.store(key, _BwdPlan(prepared, device_id))
    return dq, dk, dv


def _gradient_outputs(q, k, v, dq, dk, dv, offsets: tuple):
    """backward.gradient_outputs; with seqused_q (seqused_k) among the offsets (_call_offsets'), a new
    dq (dk, dv) starts at 0, what the rows the kernels leave read."""
    used_q, used_k = _used(offsets)
    zero = (dq is None and used_q, dk is None and used_k, dv is None and used_k)
    grads = gradient_outputs(q, k, v, dq, dk, dv, "attention_varlen_backward")
    for grad, fill in zip(grads, zero):
        if fill:
            grad.fill(0)
    return grads


@dataclasses.dataclass(frozen=True)
class _BwdPlan:
    launch: launch.BwdLaunch
    device_id: int

    def call(self, dout, q, k, v, out, lse, dq, dk, dv, slopes, cu_seqlens):
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with q.device:
                return self.call(dout, q, k, v, out, lse, dq, dk, dv, slopes, cu_seqlens)
        dq, dk, dv = _gradient_outputs(q, k, v, dq, dk, dv, cu_seqlens)
        q4, k4, v4, dout4, out4 = _aligned(q, k, v, dout, out)
        dq4, dk4, dv4 = _packed(dq, dk, dv)
        lse = lse if lse.flags.c_contiguous else cp.ascontiguousarray(lse)
        self.launch.run(q4, k4, v4, dout4, out4, lse, dq4, dk4, dv4, cp.cuda.get_current_stream().ptr, None, slopes,
                        cu_seqlens)
        return dq, dk, dv


def attention_varlen_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None, dropout_p=0.0,
                         seed=0, offset=0, seqused_q=None, seqused_k=None, mask_alignment="bottom_right"):
    """out = attention_varlen(...) and a function dout -> (dq, dk, dv), as `attention_vjp`."""
    offsets = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed, offset=offset, seqused_q=seqused_q,
                   seqused_k=seqused_k, mask_alignment=mask_alignment)
    out, lse = attention_varlen(q, k, v, *offsets, return_lse=True, **options)

    def vjp(dout, *, deterministic=False):
        return attention_varlen_backward(dout, q, k, v, out, lse, *offsets, deterministic=deterministic, **options)

    return out, vjp
