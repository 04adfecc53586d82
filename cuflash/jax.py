"""cuflash inside `jax.jit`: attention with `jax.custom_vjp` gradients, launched on XLA's stream.

    import cuflash.jax
    out = jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True))(q, k, v)
    out = cuflash.jax.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # packed batches
    out, k_cache, v_cache = cuflash.jax.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n)

The kernels run through `jax.experimental.buffer_callback` (JAX 0.7 and
later): XLA hands the callback its device buffers and its CUDA stream, and
cuflash writes the outputs in place on that stream (no copies, no
synchronisation). The forward saves q, k, v, out and the logsumexp for the
backward, as flash-attn does.

- Layout and options are `cuflash.attention`'s: q (batch, seqlen_q, nheads,
  headdim), k and v (batch, seqlen_k, nheads_kv, headdim), float16 or bfloat16.
- `jax.vmap` runs one kernel call over the mapped axis merged into the batch
  (buffer_callback's "broadcast_all": an unmapped operand is broadcast first).
- `jax.grad`, `jax.checkpoint` and `shard_map` work as with any custom_vjp
  function; each device calls the kernels on its own shard.
- fp8 (jnp.float8_e4m3fn q, k, v with descales) runs the forward only, out bfloat16.
- `attention`'s backward scratch is an output XLA allocates; the forward's
  per-stream buffers and the varlen backward's scratch come from CuPy's memory
  pool on XLA's stream: leave JAX room for them
  (`XLA_PYTHON_CLIENT_MEM_FRACTION`, or `XLA_PYTHON_CLIENT_PREALLOCATE=false`).
- The callbacks are not recorded into XLA's command buffers
  (`command_buffer_compatible=False`): with them, measured no faster
  (docs/design.md), and XLA records a callback on a stream of its own, where a
  first call would allocate the forward's per-stream buffers.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy

from . import backward as _backward
from . import forward as _forward
from . import kv_cache as _kv_cache
from . import launch as _launch
from . import score_mods as _score_mods
from . import validate as _validate
from . import varlen as _varlen
from .device import cupy, external_stream, memoised_external_array

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX < 0.7
    _buffer_callback = None


def _require_gpu_backend() -> None:
    if _buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or later); this is JAX "
                          f"{jax.__version__}")
    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(f"cuflash.jax runs on CUDA GPUs; JAX's default backend is {backend!r}")


def _option_items(causal, softmax_scale, window_size, softcap) -> tuple:
    """The options as hashable (name, value) pairs: custom_vjp's static arguments."""
    window = None if window_size is None else tuple(int(x) for x in window_size)
    return (("causal", bool(causal)), ("softmax_scale", softmax_scale), ("window_size", window),
            ("softcap", float(softcap)))


def _dropout_state(dropout_p, dropout_key):
    """(dropout_p, the seed and offset words the kernels read) of a call: 4 uint32 drawn from
    dropout_key (jax.random.bits), zeros without dropout; the backward regenerates the mask from them."""
    p = _validate.dropout(dropout_p, 0, 0)[0]
    if p == 0:
        return p, jnp.zeros((_score_mods.DROPOUT_STATE_WORDS,), jnp.uint32)
    if dropout_key is None:
        raise ValueError("dropout_key: dropout_p > 0 needs a JAX random key (jax.random.key) to draw the mask from")
    return p, jax.random.bits(dropout_key, (_score_mods.DROPOUT_STATE_WORDS,), jnp.uint32)


def _with_dropout(options: dict, state, device_id: int) -> dict:
    """cuflash's keywords: the options (a new dict), and dropout's seed words (a view of the state
    buffer) where p > 0."""
    options = dict(options)
    p = options.pop("dropout_p")
    if p == 0:
        return options
    # Under jax.vmap the words are broadcast (or batched): every element takes the first's.
    words = _cupy_view(state, (math.prod(state.shape) // _score_mods.DROPOUT_STATE_WORDS,
                               _score_mods.DROPOUT_STATE_WORDS), device_id)[0]
    return dict(options, dropout_p=p, seed=words)


def _device_of(buffer) -> int:
    """The GPU that holds an XLA buffer (under shard_map over several GPUs, the thread that runs a
    device's callback need not have that device current)."""
    return cupy().cuda.runtime.pointerGetAttributes(buffer.__cuda_array_interface__["data"][0]).device


def _cupy_view(buffer, shape, device_id: int):
    """A CuPy array over an XLA buffer on device_id (zero-copy), reshaped to `shape` (as many elements;
    e.g. leading vmapped dims merged into the batch).

    Built from the buffer's address and memoised: a DLPack import cost ~5 us a buffer on the H100
    host, plus its release when the callback returns. A buffer with strides of its own (XLA's are
    row-major) goes through DLPack."""
    interface = buffer.__cuda_array_interface__
    if interface.get("strides") is not None:
        return cupy().from_dlpack(buffer).reshape(shape)
    return memoised_external_array(interface["data"][0], tuple(shape), None, buffer.dtype, device_id)


def _batch_shape(x, rank: int = 4) -> tuple:
    """x's shape with any leading (vmapped) dims merged into the first of its last `rank` dims."""
    lead = len(x.shape) - rank + 1
    return (math.prod(x.shape[:lead]), *x.shape[lead:])


@contextlib.contextmanager
def _on_xla_stream(ctx, array):
    """XLA's stream as CuPy's current one, with the device of `array` (a view of one of the callback's
    buffers) current: under shard_map over several GPUs, the thread that runs a device's callback
    need not have that device current."""
    with array.device, external_stream(ctx.stream):
        yield


def _alibi_operand(alibi_slopes, nheads: int, batch: int):
    """alibi_slopes as a JAX array checked against the call's head count and batch (sequences of a
    packed batch), or None."""
    if alibi_slopes is None:
        return None
    slopes = jnp.asarray(alibi_slopes)
    if slopes.dtype != jnp.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                         f"{(batch, nheads)}, got {slopes.shape}")
    return slopes


def _operands(slopes) -> tuple:
    """The optional slopes as trailing callback operands."""
    return () if slopes is None else (slopes,)


def _slopes_view(slopes: tuple, batch: int, device_id: int):
    """The callback's slopes operand (if any) as cuflash takes it for a call of `batch` rows: (nheads,)
    or (batch, nheads). Under jax.vmap ("broadcast_all") the buffer gains the mapped dims in front:
    slopes of shape (batch, nheads) merge them into the batch; slopes of shape (nheads,) become a row
    per mapped element, repeated over the element's own batch (a copy on the current stream)."""
    if not slopes:
        return None
    (buffer,) = slopes
    nheads = buffer.shape[-1]
    rows = math.prod(buffer.shape[:-1])
    view = _cupy_view(buffer, (rows, nheads) if rows > 1 else (nheads,), device_id)
    if rows <= 1 or rows == batch:
        return view
    return cupy().repeat(view, batch // rows, axis=0)


def _forward_callback(options, ctx, outputs, q, k, v, state, *slopes):
    out, lse = outputs
    device_id = _device_of(out)
    qc, kc, vc = (_cupy_view(x, _batch_shape(x), device_id) for x in (q, k, v))
    with _on_xla_stream(ctx, qc):
        _forward.attention(qc, kc, vc, out=_cupy_view(out, _batch_shape(out), device_id),
                           lse=_cupy_view(lse, _batch_shape(lse, 3), device_id),
                           alibi_slopes=_slopes_view(slopes, qc.shape[0], device_id),
                           **_with_dropout(options, state, device_id))


def _backward_callback(options, deterministic, ctx, outputs, dout, q, k, v, out, lse, state, *slopes):
    *grads, scratch = outputs
    device_id = _device_of(scratch)
    dq, dk, dv = (_cupy_view(x, _batch_shape(x), device_id) for x in grads)
    inputs = [_cupy_view(x, _batch_shape(x), device_id) for x in (dout, q, k, v, out)]
    with _on_xla_stream(ctx, dq):
        workspace = _launch.BackwardWorkspace(0, device_id, _cupy_view(scratch, (math.prod(scratch.shape),), device_id))
        _backward.attention_backward(*inputs, _cupy_view(lse, _batch_shape(lse, 3), device_id), dq=dq, dk=dk,
                                     dv=dv, deterministic=deterministic, workspace=workspace,
                                     alibi_slopes=_slopes_view(slopes, dq.shape[0], device_id),
                                     **_with_dropout(options, state, device_id))


def _forward_call(q, k, v, state, options, slopes=None):
    batch, seqlen_q, nheads, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32))
    call = _buffer_callback(functools.partial(_forward_callback, options), shapes, vmap_method="broadcast_all")
    return call(q, k, v, state, *_operands(slopes))


def _backward_call(dout, q, k, v, out, lse, state, options, deterministic, slopes=None):
    # The backward's scratch is one more output, so that XLA owns it: no allocation in the call.
    batch = int(numpy.prod(q.shape[:-3]))  # vmapped dims merge into the batch
    floats = _backward.workspace_floats((batch, *q.shape[-3:]), (batch, *k.shape[-3:]), q.dtype,
                                        alibi=slopes is not None, deterministic=deterministic,
                                        device_id=cupy().cuda.Device().id,
                                        **{name: options[name] for name in ("causal", "window_size", "softcap")})
    shapes = (*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
              jax.ShapeDtypeStruct((max(floats, 1),), jnp.float32))
    call = _buffer_callback(functools.partial(_backward_callback, options, deterministic), shapes,
                            vmap_method="broadcast_all")
    return call(dout, q, k, v, out, lse, state, *_operands(slopes))[:3]


def _no_cotangent(x):
    """The cotangent of an integer input: float0 zeros."""
    return numpy.zeros(x.shape, jax.dtypes.float0)


def _slopes_cotangent(slopes):
    """ALiBi's slopes take no gradient (as in flash-attn): zeros, or None where absent."""
    return None if slopes is None else jnp.zeros_like(slopes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, slopes, state, options, deterministic):
    return _forward_call(q, k, v, state, dict(options), slopes)[0]


def _attention_fwd(q, k, v, slopes, state, options, deterministic):
    out, lse = _forward_call(q, k, v, state, dict(options), slopes)
    return out, (q, k, v, out, lse, slopes, state)


def _attention_bwd(options, deterministic, residuals, dout):
    q, k, v, out, lse, slopes, state = residuals
    return (*_backward_call(dout, q, k, v, out, lse, state, dict(options), deterministic, slopes),
            _slopes_cotangent(slopes), _no_cotangent(state))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_key=None, q_descale=None,
              k_descale=None, v_descale=None):
    """`cuflash.attention` on JAX arrays, usable inside `jax.jit`, differentiable (`jax.grad`, `jax.vjp`).

    alibi_slopes: float32 (nheads,) or (batch, nheads), as `cuflash.attention`'s; no gradient flows
    to them (zeros), as in flash-attn.
    deterministic: the backward's dq without atomics (bitwise reproducible).
    dropout_p, dropout_key: dropout on the probabilities, its mask's seed and offset drawn from
    the JAX random key (`jax.random.bits(dropout_key, (4,), uint32)`, the words `cuflash.attention`
    takes as `seed`); the kernels read them on the device and the backward regenerates the mask.
    Under `jax.vmap` the mapped elements share one key (the first's; their masks differ by their
    index in the merged batch), so a vmapped call is not the calls of its elements.
    fp8: q, k and v jnp.float8_e4m3fn with q_descale, k_descale, v_descale float32 (batch, nheads_kv)
    (ones where None); out is bfloat16. Forward only (Hopper), with causal, window and softcap.
    dropout_p is checked when traced, the other options when the kernels first run (inside the
    computation); their errors name the argument as `cuflash.attention`'s do.
    """
    _require_gpu_backend()
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must have 4 dims (batch, seqlen, nheads, headdim), got shapes {q.shape}, "
                         f"{k.shape}, {v.shape}")
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if q.dtype == jnp.float8_e4m3fn:
        return _fp8_attention(q, k, v, descales, _option_items(causal, softmax_scale, window_size, softcap),
                              alibi_slopes, dropout_p)
    for name, x in descales.items():
        if x is not None:
            raise ValueError(f"{name} applies to fp8 (float8_e4m3fn) inputs only, got q of {q.dtype}")
    slopes = _alibi_operand(alibi_slopes, q.shape[2], q.shape[0])
    p, state = _dropout_state(dropout_p, dropout_key)
    options = (*_option_items(causal, softmax_scale, window_size, softcap), ("dropout_p", p))
    return _attention(q, k, v, slopes, state, options, bool(deterministic))


# ---------------------------------------------------------------- fp8 (forward only)

def _fp8_forward_callback(names, options, ctx, outputs, q, k, v, *descales):
    out, lse = outputs
    device_id = _device_of(out)
    qc, kc, vc = (_cupy_view(x, _batch_shape(x), device_id) for x in (q, k, v))
    given = {name: _cupy_view(x, _batch_shape(x, 2), device_id) for name, x in zip(names, descales)}
    with _on_xla_stream(ctx, qc):
        _forward.attention(qc, kc, vc, out=_cupy_view(out, _batch_shape(out), device_id),
                           lse=_cupy_view(lse, _batch_shape(lse, 3), device_id), **given, **options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_call(q, k, v, descales, names, options):
    # e4m3 crosses the callback as its uint8 codes (buffer callbacks take no float8 buffer).
    codes = [jax.lax.bitcast_convert_type(x, jnp.uint8) for x in (q, k, v)]
    batch, seqlen_q, nheads, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
              jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32))
    call = _buffer_callback(functools.partial(_fp8_forward_callback, names, dict(options)), shapes,
                            vmap_method="broadcast_all")
    return call(*codes, *descales)[0]


def _fp8_call_fwd(q, k, v, descales, names, options):
    return _fp8_call(q, k, v, descales, names, options), None


def _fp8_call_bwd(names, options, residuals, dout):
    raise NotImplementedError("cuflash.jax.attention: fp8 (float8_e4m3fn) inputs have a forward only")


_fp8_call.defvjp(_fp8_call_fwd, _fp8_call_bwd)


def _fp8_attention(q, k, v, descales: dict, options: tuple, alibi_slopes, dropout_p):
    for name, x in (("k", k), ("v", v)):
        if x.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"{name} must be float8_e4m3fn as q is, got {x.dtype}")
    if alibi_slopes is not None or _validate.dropout(dropout_p, 0, 0)[0]:
        raise ValueError("alibi_slopes and dropout_p: fp8 attention takes causal, window_size and softcap only")
    names = tuple(name for name, x in descales.items() if x is not None)
    return _fp8_call(q, k, v, tuple(jnp.asarray(descales[name], jnp.float32) for name in names), names, options)


# ---------------------------------------------------------------- packed batches

def _varlen_slopes(slopes: tuple, device_id: int):
    return _cupy_view(slopes[0], slopes[0].shape, device_id) if slopes else None


def _varlen_forward_callback(lengths, options, ctx, outputs, q, k, v, cu_q, cu_k, state, *slopes):
    device_id = _device_of(outputs[0])
    out, lse = (_cupy_view(x, x.shape, device_id) for x in outputs)
    with _on_xla_stream(ctx, out):
        _varlen.attention_varlen(*(_cupy_view(x, x.shape, device_id) for x in (q, k, v, cu_q, cu_k)), *lengths,
                                 out=out, lse=lse, alibi_slopes=_varlen_slopes(slopes, device_id),
                                 **_with_dropout(options, state, device_id))


def _varlen_backward_callback(lengths, options, deterministic, ctx, outputs, dout, q, k, v, out, lse, cu_q, cu_k,
                              state, *slopes):
    device_id = _device_of(outputs[0])
    dq, dk, dv = (_cupy_view(x, x.shape, device_id) for x in outputs)
    arrays = [_cupy_view(x, x.shape, device_id) for x in (dout, q, k, v, out, lse, cu_q, cu_k)]
    with _on_xla_stream(ctx, dq):
        _varlen.attention_varlen_backward(*arrays, *lengths, dq=dq, dk=dk, dv=dv, deterministic=deterministic,
                                          alibi_slopes=_varlen_slopes(slopes, device_id),
                                          **_with_dropout(options, state, device_id))


def _varlen_forward_call(q, k, v, cu_q, cu_k, slopes, state, lengths, options):
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
    call = _buffer_callback(functools.partial(_varlen_forward_callback, lengths, options), shapes,
                            vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k, state, *_operands(slopes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention_varlen(q, k, v, cu_q, cu_k, slopes, state, lengths, options, deterministic):
    return _varlen_forward_call(q, k, v, cu_q, cu_k, slopes, state, lengths, dict(options))[0]


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, slopes, state, lengths, options, deterministic):
    out, lse = _varlen_forward_call(q, k, v, cu_q, cu_k, slopes, state, lengths, dict(options))
    return out, (q, k, v, cu_q, cu_k, slopes, state, out, lse)


def _attention_varlen_bwd(lengths, options, deterministic, residuals, dout):
    q, k, v, cu_q, cu_k, slopes, state, out, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = _buffer_callback(functools.partial(_varlen_backward_callback, lengths, dict(options), deterministic),
                            shapes, vmap_method="sequential")
    dq, dk, dv = call(dout, q, k, v, out, lse, cu_q, cu_k, state, *_operands(slopes))
    return (dq, dk, dv, _no_cotangent(cu_q), _no_cotangent(cu_k), _slopes_cotangent(slopes),
            _no_cotangent(state))


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                     dropout_p=0.0, dropout_key=None):
    """`cuflash.attention_varlen` on JAX arrays inside `jax.jit`, differentiable in q, k and v.

    q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim); cu_seqlens_q and
    cu_seqlens_k int32 (batch + 1,) JAX arrays (their values are the caller's contract, as for
    device offsets in cuflash.attention_varlen); max_seqlen_q, max_seqlen_k: Python ints.
    alibi_slopes: float32 (nheads,) or (batch, nheads), as `attention`'s.
    dropout_p, dropout_key: as `attention`'s. `jax.vmap` runs one call per mapped element
    ("sequential").
    """
    _require_gpu_backend()
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k and v must have 3 dims (total, nheads, headdim), got shapes {q.shape}, {k.shape}, "
                         f"{v.shape}")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dtype != jnp.int32 or x.ndim != 1:
            raise ValueError(f"{name} must be an int32 array of shape (batch + 1,), got {x.dtype} {x.shape}")
    lengths = (int(max_seqlen_q), int(max_seqlen_k))
    slopes = _alibi_operand(alibi_slopes, q.shape[1], cu_seqlens_q.shape[0] - 1)
    p, state = _dropout_state(dropout_p, dropout_key)
    options = (*_option_items(causal, softmax_scale, window_size, softcap), ("dropout_p", p))
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, slopes, state, lengths, options,
                             bool(deterministic))


# ---------------------------------------------------------------- KV cache

# The optional array arguments of attention_with_kvcache, in the order the callback receives them.
_KVCACHE_ARRAYS = ("k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "rotary_cos",
                   "rotary_sin", "alibi_slopes", "k_descale", "v_descale")


def _kvcache_callback(names, options, ctx, outputs, q, k_cache, v_cache, *arrays):
    # The caches' outputs alias their inputs: the append lands there.
    device_id = _device_of(outputs[0])
    out, k_out, v_out = (_cupy_view(x, x.shape, device_id) for x in outputs)
    given = {name: _cupy_view(x, x.shape, device_id) for name, x in zip(names, arrays)}
    with _on_xla_stream(ctx, out):
        _kv_cache.attention_with_kvcache(_cupy_view(q, q.shape, device_id), k_out, v_out, out=out, **given,
                                         **options)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, causal=False, softmax_scale=None, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, k_descale=None, v_descale=None, num_splits=0):
    """`cuflash.attention_with_kvcache` on JAX arrays inside `jax.jit`: returns (out, k_cache, v_cache),
    the caches with the new keys and values appended. An e4m3 cache is jnp.float8_e4m3fn (or uint8
    codes), with k_descale / v_descale float32 (batch, nheads_kv).

    The caches' outputs alias their inputs (buffer_callback's input_output_aliases): donate them
    (`jax.jit(step, donate_argnums=...)`) and XLA appends in place; otherwise XLA copies each cache
    first. cache_seqlens: an int32 (batch,) JAX array or a Python int. The other arrays are JAX
    arrays, their values the caller's contract as for device arrays in cuflash.attention_with_kvcache.
    Not differentiable; `jax.vmap` is not supported (batch the call instead).
    """
    _require_gpu_backend()
    options = dict(_option_items(causal, softmax_scale, window_size, softcap))
    options.update(rotary_interleaved=bool(rotary_interleaved), num_splits=int(num_splits))
    arrays = dict(k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                  k_descale=k_descale, v_descale=v_descale)
    if isinstance(cache_seqlens, int):
        options["cache_seqlens"] = arrays.pop("cache_seqlens")
    names = tuple(name for name in _KVCACHE_ARRAYS if arrays.get(name) is not None)
    # An e4m3 cache crosses the callback as its uint8 codes (buffer callbacks take no float8 buffer).
    cache_dtype = k_cache.dtype
    float8 = cache_dtype == jnp.float8_e4m3fn
    if float8:
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint8) for c in (k_cache, v_cache))
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k_cache, v_cache))
    call = _buffer_callback(functools.partial(_kvcache_callback, names, options), shapes,
                            input_output_aliases={1: 1, 2: 2})
    out, k_cache, v_cache = call(q, k_cache, v_cache, *(arrays[name] for name in names))
    if float8:
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, cache_dtype) for c in (k_cache, v_cache))
    return out, k_cache, v_cache
