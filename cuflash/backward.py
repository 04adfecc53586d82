"""`attention_backward` and `attention_vjp`: gradients by FlashAttention-2 recomputation.

The forward keeps only out and the logsumexp (O(N) memory); the backward
recomputes P tile by tile from them. Kernels are in cuda_src/bwd_sm80.cuh
(every GPU) and cuda_src/bwd_sm90.cuh (head dims 33-256 on compute
capability 9.0: dK/dV with a fused dQ up to head dim 128, and a dQ kernel for
deterministic mode and for head dims 160-256 in either mode).
"""

from __future__ import annotations

import dataclasses

from . import arrays, dispatch, launch, score_mods, tuner, validate
from .arrays import aligned_copy, is_aligned
from .device import compute_capability, cupy, max_smem_per_block
from .forward import attention, autotune_requested
from .plans import PlanCache, layout, ndarray_type, option_key, optional_layout


def _problem(q, k, causal, window_size, softcap, alibi_slopes, deterministic, dtype_name: str,
             device_id: int, dropout=(0.0, 0, 0)) -> dispatch.BwdProblem:
    """The backward problem of validated arrays, after checking the score options; dropout: (p, seed, offset)."""
    causal, mods = validate.score_options(q, k, causal, window_size, softcap, alibi_slopes, *dropout)
    return dispatch.BwdProblem(dtype_name, q.shape[3], causal, q.shape[1], k.shape[1],
                               q.shape[2] // k.shape[2], validate.flag("deterministic", deterministic),
                               max_smem_per_block(device_id),
                               compute_capability(device_id), mods)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
                       workspace=None, tune=False, dropout_p=0.0, seed=0, offset=0):
    """Gradients (dq, dk, dv) of attention(q, k, v) given dout = dL/d(out).

    out and lse are the forward's results (`attention(..., return_lse=True)`),
    with the same causal, window_size, softcap, alibi_slopes, softmax_scale and dropout_p, seed,
    offset (the mask is regenerated, not stored). GQA: dk and dv sum over the query
    heads that share a kv head. deterministic=True computes dq in a separate
    pass without atomics, so repeated calls give identical bits.
    dq, dk, dv: optional output arrays (shapes and dtype of q, k, v).
    workspace: from `backward_workspace` for this call's shapes; with it and
    dq, dk, dv given the call allocates nothing (CUDA graph capture).
    tune: first autotune this problem at this shape unless the tuning cache
    has it (also on with CUFLASH_AUTOTUNE=1), as `attention(..., tune=True)`.
    """
    key = None
    if not tune and not dropout_p:
        key = _plan_key(dout, q, k, v, out, lse, causal, (window_size, softcap, alibi_slopes), softmax_scale,
                        deterministic, dq, dk, dv, workspace)
        plan = _plans.get(key) if key is not None else None
        if plan is not None:
            return plan.call(dout, q, k, v, out, lse, dq, dk, dv, workspace, alibi_slopes)
    validate.require_cupy_array("dout", dout)
    dtype_name = validate.qkv(q, k, v)
    validate.like("dout", dout, q, "q")
    validate.like("out", out, q, "q")
    validate.lse_array("lse", lse, q, writable=False)
    for name, x, ref, ref_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if x is not None:
            validate.output(name, x, ref, ref_name)
    validate.disjoint({"dq": dq, "dk": dk, "dv": dv}, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    if workspace is not None and not isinstance(workspace, launch.BackwardWorkspace):
        raise TypeError(f"workspace must come from cuflash.backward_workspace, got {type(workspace).__name__}")
    scale = validate.softmax_scale(softmax_scale, q.shape[3])
    device_id = validate.cuda_device(q)
    problem = _problem(q, k, causal, window_size, softcap, alibi_slopes, deterministic, dtype_name, device_id,
                       (dropout_p, seed, offset))
    if workspace is not None and workspace.device_id != device_id:
        raise ValueError(f"workspace is on device {workspace.device_id}, q on device {device_id}")

    cp = cupy()
    batch, _, nheads, _ = q.shape
    with q.device:
        dq, dk, dv = gradient_outputs(q, k, v, dq, dk, dv, "attention_backward")
        if q.size == 0 or k.size == 0:
            for g in (dq, dk, dv):
                g.fill(0)
            return dq, dk, dv
        copies = tuple(not is_aligned(x) for x in (q, k, v, dout, out)) + (not lse.flags.c_contiguous,)
        q, k, v, dout, out, lse = _copied(copies, q, k, v, dout, out, lse)
        autotune = autotune_requested(tune) and problem.mods.tuned  # varlen and dropout are not tuned
        if autotune:
            tuner.tune_bwd_call(problem, batch, nheads, k.shape[2])
        cfg, _ = dispatch.bwd_config(problem)
        prepared = launch.prepare_bwd(cfg, problem, scale, q, k, v, dout, out, lse, dq, dk, dv, device_id)
        prepared.run(q, k, v, dout, out, lse, dq, dk, dv, cp.cuda.get_current_stream().ptr, workspace, alibi_slopes)
    if key is not None and not autotune:
        _plans.store(key, _Plan(prepared, copies, device_id))
    return dq, dk, dv


def gradient_outputs(q, k, v, dq, dk, dv, what: str):
    """dq, dk, dv as given, the missing ones new arrays shaped as q, k, v on the current device (never
    while the stream captures a CUDA graph). what: the call, for that error."""
    if dq is None or dk is None or dv is None:
        launch.require_not_capturing(f"{what} without dq=, dk= and dv=")
        cp = cupy()
        dq = cp.empty(q.shape, q.dtype) if dq is None else dq
        dk = cp.empty(k.shape, k.dtype) if dk is None else dk
        dv = cp.empty(v.shape, v.dtype) if dv is None else dv
    return dq, dk, dv


def _copied(copies, q, k, v, dout, out, lse):
    """The arrays as the kernels read them: aligned copies of q, k, v, dout, out and a contiguous
    lse where `copies` says so."""
    if not any(copies):
        return q, k, v, dout, out, lse
    launch.require_not_capturing("attention_backward with misaligned or strided inputs")
    arrays = [aligned_copy(x) if copy else x for x, copy in zip((q, k, v, dout, out), copies)]
    return (*arrays, cupy().ascontiguousarray(lse) if copies[5] else lse)


# ---------------------------------------------------------------- repeated calls
# See cuflash/plans.py.
_plans = PlanCache()


@dataclasses.dataclass(frozen=True)
class _Plan:
    launch: launch.BwdLaunch
    copies: tuple  # whether q, k, v, dout, out go to the kernels as aligned copies, lse as a contiguous one
    device_id: int

    def call(self, dout, q, k, v, out, lse, dq, dk, dv, workspace, slopes):
        cp = cupy()
        if cp.cuda.runtime.getDevice() != self.device_id:
            with q.device:
                return self.call(dout, q, k, v, out, lse, dq, dk, dv, workspace, slopes)
        dq, dk, dv = gradient_outputs(q, k, v, dq, dk, dv, "attention_backward")
        q, k, v, dout, out, lse = _copied(self.copies, q, k, v, dout, out, lse)
        self.launch.run(q, k, v, dout, out, lse, dq, dk, dv, cp.cuda.get_current_stream().ptr, workspace, slopes)
        return dq, dk, dv


def _plan_key(dout, q, k, v, out, lse, causal, mods, softmax_scale, deterministic, dq, dk, dv, workspace):
    """The plan key of a call with these arguments, or None where only the full path applies.
    mods: (window_size, softcap, alibi_slopes) as given."""
    ndarray = ndarray_type()
    window_size, softcap, alibi_slopes = mods
    options = option_key(window_size, softcap, softmax_scale)
    if options is None or type(causal) is not bool or type(deterministic) is not bool:
        return None
    if workspace is not None and type(workspace) is not launch.BackwardWorkspace:
        return None
    for x in (dout, q, k, v, out, lse):
        if type(x) is not ndarray:
            return None
    try:
        grads = optional_layout(dq), optional_layout(dk), optional_layout(dv), optional_layout(alibi_slopes)
    except LookupError:
        return None
    return (layout(dout), layout(q), layout(k), layout(v), layout(out), layout(lse), grads,
            None if workspace is None else workspace.device_id, causal, options, deterministic,
            dispatch.cache_state())


def backward_workspace(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, dropout_p=0.0):
    """Scratch memory for `attention_backward` calls with these shapes, dtype and options.

    Passing it (with dq, dk, dv) makes a backward call allocate nothing, which
    capturing it in a CUDA graph needs; one workspace serves any number of
    calls that run one after another.
    """
    dtype_name = validate.qkv(q, k, v)
    device_id = validate.cuda_device(q)
    problem = _problem(q, k, causal, window_size, softcap, alibi_slopes, deterministic, dtype_name, device_id,
                       (dropout_p, 0, 0))
    return launch.BackwardWorkspace(_workspace_floats(problem, q.shape), device_id)


def workspace_floats(q_shape, k_shape, dtype, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi=False,
                     deterministic=False, device_id: int = 0) -> int:
    """The float32 values of `backward_workspace` for arrays of these shapes and dtype, without the
    arrays: a framework sizes a workspace of its own with it while tracing (cuflash.jax). alibi:
    whether the calls take alibi_slopes."""
    dtype_name = arrays.dtype_name(dtype)
    if dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"the backward computes in float16 or bfloat16, got {dtype}")
    causal = validate.flag("causal", causal)
    causal, mods = score_mods.normalise(causal, validate.window_size(window_size, causal),
                                        validate.softcap(softcap), 0 if alibi else None, q_shape[1], k_shape[1])
    problem = dispatch.BwdProblem(dtype_name, q_shape[3], causal, q_shape[1], k_shape[1], q_shape[2] // k_shape[2],
                                  validate.flag("deterministic", deterministic), max_smem_per_block(device_id),
                                  compute_capability(device_id),
                                  mods)
    return _workspace_floats(problem, q_shape)


def _workspace_floats(problem: dispatch.BwdProblem, q_shape) -> int:
    cfg, _ = dispatch.bwd_config(problem)
    return launch.BackwardWorkspace.floats_for(cfg, launch.buffer_rows(problem, q_shape)[1], problem.deterministic)


def attention_vjp(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, dropout_p=0.0, seed=0, offset=0):
    """out = attention(q, k, v) and a function dout -> (dq, dk, dv).

    Keeps only q, k, v, out and the logsumexp alive (O(N) extra memory): the
    glue for jax.custom_vjp, CuPy autodiff or a hand-written training loop.
    """
    validate.qkv(q, k, v)  # 16-bit only: no fp8 backward
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed, offset=offset)
    out, lse = attention(q, k, v, return_lse=True, **options)

    def vjp(dout, *, deterministic=False):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)

    return out, vjp
