"""cuflash inside `jax.jit`: attention with `jax.custom_vjp` gradients, launched on XLA's stream.

    import cuflash.jax
    out = jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True))(q, k, v)
    out = cuflash.jax.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # packed batches
    out, k_cache, v_cache = cuflash.jax.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n)
    out = cuflash.jax.dot_product_attention(q, k, v, is_causal=True)  # jax.nn's name and semantics

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

import functools

import jax
import jax.numpy as jnp
import numpy

from . import fp8 as _fp8
from . import kv_cache as _kv_cache
from . import score_mods as _score_mods
from . import validate as _validate
from . import varlen as _varlen
from .jax_callbacks import (backward_call, buffer_callback, cupy_view, device_of, dropout_state,
                            forward_call, on_xla_stream, option_items, split_dropout, with_dropout)


def _require_gpu_backend() -> None:
    if buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or later); this is JAX "
                          f"{jax.__version__}")
    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(f"cuflash.jax runs on CUDA GPUs; JAX's default backend is {backend!r}")


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


def _codes(x):
    """An e4m3 array as its uint8 codes (buffer callbacks take no float8 buffer); others as they are."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype == jnp.float8_e4m3fn else x


def _no_cotangent(x):
    """The cotangent of an integer input: float0 zeros."""
    return numpy.zeros(x.shape, jax.dtypes.float0)


def _slopes_cotangent(slopes):
    """ALiBi's slopes take no gradient (as in flash-attn): zeros, or None where absent."""
    return None if slopes is None else jnp.zeros_like(slopes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, slopes, state, options, deterministic):
    """(out, lse) of cuflash.attention; the lse leaves `attention` through stop_gradient."""
    return forward_call(q, k, v, state, dict(options), slopes)


def _attention_fwd(q, k, v, slopes, state, options, deterministic):
    out, lse = forward_call(q, k, v, state, dict(options), slopes)
    return (out, lse), (q, k, v, out, lse, slopes, state)


def _attention_bwd(options, deterministic, residuals, cotangents):
    # The lse's cotangent is zero (stop_gradient): only out's is taken.
    q, k, v, out, lse, slopes, state = residuals
    return (*backward_call(cotangents[0], q, k, v, out, lse, state, dict(options), deterministic, slopes),
            _slopes_cotangent(slopes), _no_cotangent(state))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_key=None, q_descale=None,
              k_descale=None, v_descale=None, return_lse=False):
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
    return_lse: (out, lse), lse float32 (batch, nheads, seqlen_q) as `cuflash.attention`'s, through
    jax.lax.stop_gradient (16-bit inputs).
    The shapes, flags, window_size and dropout_p are checked when traced, the other options when the
    kernels first run (inside the computation); their errors name the argument as `cuflash.attention`'s do.
    """
    _require_gpu_backend()
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must have 4 dims (batch, seqlen, nheads, headdim), got shapes {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's batch size {q.shape[0]}, got shape {k.shape}")
    _validate.head_shapes(q.shape, k.shape, v.shape)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return_lse = _validate.flag("return_lse", return_lse)
    if q.dtype == jnp.float8_e4m3fn:
        if return_lse:
            raise NotImplementedError("cuflash.jax.attention: return_lse with fp8 (float8_e4m3fn) inputs is not "
                                      "supported")
        return _fp8_attention(q, k, v, descales, option_items(causal, softmax_scale, window_size, softcap),
                              alibi_slopes, dropout_p)
    _fp8.refuse_descales(**descales)
    slopes = _alibi_operand(alibi_slopes, q.shape[2], q.shape[0])
    p, state = dropout_state(dropout_p, dropout_key)
    options = (*option_items(causal, softmax_scale, window_size, softcap), ("dropout_p", p))
    deterministic = _validate.flag("deterministic", deterministic)
    out, lse = _attention(q, k, v, slopes, state, options, deterministic)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# ---------------------------------------------------------------- jax.nn's interface

_JAX_NN_IMPLEMENTATIONS = (None, "xla", "cudnn")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
    """`jax.nn.dot_product_attention` on cuflash's kernels (`attention`), with its semantics, for a port
    that changes one name: query (B, T, N, H) or (T, N, H), key and value (B, S, K, H) or (S, K, H), N a
    multiple of K (GQA), float16 or bfloat16; scale 1/sqrt(H) by default; is_causal and local_window_size
    (an int: the same bound left and right) aligned to the top-left corner as there (query i sees keys
    j <= i, and i - left <= j <= i + right), which cuflash runs as a bottom-right window over the keys
    that can be seen (score_mods.from_top_left). implementation: accepted (None, "xla", "cudnn") and
    unused. return_residual: (out, the logsumexp (B, T, N) or (T, N) in key's dtype, without gradient).
    query_seq_lengths, key_value_seq_lengths: int32 (B,), a padded batch whose sequence b uses its
    first rows only (the others take no part; out and the gradients hold 0 in the query and key rows
    past them): `attention_varlen` runs it as a packed batch of spans T and S with those used
    lengths and the masks aligned top-left. A query row that sees no key gets 0 there.
    Not supported, each raising NotImplementedError by name: bias, mask, and windows that leave a
    query without any key in a call without lengths (jax.nn averages every value there)."""
    for name, given in (("bias", bias), ("mask", mask)):
        if given is not None:
            raise NotImplementedError(f"dot_product_attention: {name} is not supported by cuflash (pass None); "
                                      "jax.nn.dot_product_attention runs it")
    return_residual = _validate.flag("return_residual", return_residual)
    if implementation not in _JAX_NN_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_JAX_NN_IMPLEMENTATIONS}, got {implementation!r}")
    if query.ndim != key.ndim or key.ndim not in (3, 4):
        raise ValueError(f"query, key and value must have 4 dims (B, T, N, H) or 3 (T, N, H), got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if query.ndim == 3:
        result = dot_product_attention(query[None], key[None], value[None], scale=scale, is_causal=is_causal,
                                       query_seq_lengths=query_seq_lengths,
                                       key_value_seq_lengths=key_value_seq_lengths,
                                       local_window_size=local_window_size, return_residual=return_residual)
        return (result[0][0], result[1][0]) if return_residual else result[0]
    if local_window_size is not None:
        pair = (local_window_size,) * 2 if _validate.is_int(local_window_size) else local_window_size
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_validate.is_int(x) for x in pair):
            raise TypeError(f"local_window_size must be an int or a pair of ints >= 0, got {local_window_size!r}")
        local_window_size = tuple(int(x) for x in pair)
        if any(x < 0 for x in local_window_size):
            raise ValueError(f"local_window_size must be ints >= 0, got {local_window_size!r}")
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        return _padded_batch(query, key, value, scale, _validate.flag("is_causal", is_causal), local_window_size,
                             (query_seq_lengths, key_value_seq_lengths), return_residual)
    keys, window = _score_mods.from_top_left(query.shape[1], key.shape[1],
                                             _validate.flag("is_causal", is_causal), local_window_size)
    if keys < key.shape[1]:
        key, value = key[:, :keys], value[:, :keys]
    if not return_residual:
        return attention(query, key, value, softmax_scale=scale, window_size=window)
    out, lse = attention(query, key, value, softmax_scale=scale, window_size=window, return_lse=True)
    return out, jnp.transpose(lse, (0, 2, 1)).astype(key.dtype)


def _padded_batch(query, key, value, scale, is_causal: bool, window, seq_lengths: tuple, return_residual: bool):
    """dot_product_attention of a padded batch with sequence lengths: a packed batch of B spans of T
    query and S key rows, the used rows the lengths (None: the whole span), masks aligned top-left."""
    batch, seqlen_q, nheads, headdim = query.shape
    seqlen_k, nheads_kv = key.shape[1], key.shape[2]
    if key.shape[0] != batch:
        raise ValueError(f"key must have query's batch size {batch}, got shape {key.shape}")
    if batch * max(seqlen_q, seqlen_k) >= _validate.INT32_ROWS:
        raise ValueError(f"query_seq_lengths: a padded batch of {batch} x {max(seqlen_q, seqlen_k)} rows passes "
                         "the kernels' int32 row count")
    used = []
    for name, lengths in zip(("query_seq_lengths", "key_value_seq_lengths"), seq_lengths):
        if lengths is not None:
            lengths = jnp.asarray(lengths)
            _int32_vector(name, lengths, batch)
        used.append(lengths)
    starts = jnp.arange(batch + 1, dtype=jnp.int32)
    result = attention_varlen(query.reshape(batch * seqlen_q, nheads, headdim),
                              *(x.reshape(batch * seqlen_k, nheads_kv, headdim) for x in (key, value)),
                              starts * seqlen_q, starts * seqlen_k, seqlen_q, seqlen_k, causal=is_causal,
                              softmax_scale=scale, window_size=(-1, -1) if window is None else window,
                              seqused_q=used[0], seqused_k=used[1], mask_alignment="top_left",
                              return_lse=return_residual)
    out, lse = result if return_residual else (result, None)
    out = out.reshape(query.shape)
    if not return_residual:
        return out
    return out, jnp.transpose(lse.reshape(nheads, batch, seqlen_q), (1, 2, 0)).astype(key.dtype)


# ---------------------------------------------------------------- fp8 (forward only)

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_call(q, k, v, descales, names, options):
    no_dropout = dropout_state(0.0, None)[1]
    return forward_call(*(_codes(x) for x in (q, k, v)), no_dropout, dict(options, dropout_p=0.0),
                        descales=dict(zip(names, descales)), out_dtype=jnp.bfloat16)[0]


def _fp8_call_fwd(q, k, v, descales, names, options):
    return _fp8_call(q, k, v, descales, names, options), None


def _fp8_call_bwd(names, options, residuals, dout):
    raise NotImplementedError("cuflash.jax.attention: fp8 (float8_e4m3fn) inputs have a forward only")


_fp8_call.defvjp(_fp8_call_fwd, _fp8_call_bwd)


def _fp8_attention(q, k, v, descales: dict, options: tuple, alibi_slopes, dropout_p):
    for name, x in (("k", k), ("v", v)):
        if x.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"{name} must be float8_e4m3fn as q is, got {x.dtype}")
    _fp8.refuse_options(alibi_slopes, dropout=bool(_validate.dropout(dropout_p, 0, 0)[0]))
    names = tuple(name for name, x in descales.items() if x is not None)
    return _fp8_call(q, k, v, tuple(jnp.asarray(descales[name], jnp.float32) for name in names), names, options)


# ---------------------------------------------------------------- packed batches

def _varlen_operands(names: tuple, buffers: tuple, device_id: int) -> dict:
    return {name: cupy_view(x, x.shape, device_id) for name, x in zip(names, buffers)}


def _varlen_forward_callback(lengths, kwargs, p, names, ctx, outputs, q, k, v, cu_q, cu_k, state, *named):
    """The forward of a packed batch; `named` holds the optional operands named in `names`
    (alibi_slopes, block_table, seqused_q, seqused_k), passed to cuflash.attention_varlen by those
    names. With seqused_q the rows the kernels leave are set first: out 0, lse -inf (XLA's buffers
    start undefined)."""
    device_id = device_of(outputs[0], ctx.stream)
    out, lse = (cupy_view(x, x.shape, device_id) for x in outputs)
    with on_xla_stream(ctx, out):
        if "seqused_q" in names:
            out.fill(0)
            lse.fill(-numpy.inf)
        _varlen.attention_varlen(*(cupy_view(x, x.shape, device_id) for x in (q, k, v, cu_q, cu_k)), *lengths,
                                 out=out, lse=lse, **_varlen_operands(names, named, device_id),
                                 **with_dropout(kwargs, p, state, device_id))


def _varlen_backward_callback(lengths, kwargs, p, deterministic, names, ctx, outputs, dout, q, k, v, out, lse, cu_q,
                              cu_k, state, *named):
    """The backward of a packed batch; gradient rows past seqused_q (dq) and seqused_k (dk, dv) are 0."""
    device_id = device_of(outputs[0], ctx.stream)
    dq, dk, dv = (cupy_view(x, x.shape, device_id) for x in outputs)
    arrays = [cupy_view(x, x.shape, device_id) for x in (dout, q, k, v, out, lse, cu_q, cu_k)]
    with on_xla_stream(ctx, dq):
        for grad, used in ((dq, "seqused_q"), (dk, "seqused_k"), (dv, "seqused_k")):
            if used in names:
                grad.fill(0)
        _varlen.attention_varlen_backward(*arrays, *lengths, dq=dq, dk=dk, dv=dv, deterministic=deterministic,
                                          **_varlen_operands(names, named, device_id),
                                          **with_dropout(kwargs, p, state, device_id))


def _varlen_forward_call(q, k, v, cu_q, cu_k, named: tuple, state, names: tuple, lengths, options):
    """(out, lse) of cuflash.attention_varlen on JAX arrays; named: the operands named in `names`."""
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
    call = buffer_callback(functools.partial(_varlen_forward_callback, lengths, *split_dropout(options), names),
                           shapes, vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k, state, *named)


def _operand_cotangent(x):
    """No gradient reaches a packed batch's optional operands: zeros (ALiBi's slopes, as in flash-attn),
    float0 for integer ones."""
    return jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else _no_cotangent(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _attention_varlen(q, k, v, cu_q, cu_k, named, state, names, lengths, options, deterministic):
    return _varlen_forward_call(q, k, v, cu_q, cu_k, named, state, names, lengths, dict(options))


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, named, state, names, lengths, options, deterministic):
    out, lse = _varlen_forward_call(q, k, v, cu_q, cu_k, named, state, names, lengths, dict(options))
    return (out, lse), (q, k, v, cu_q, cu_k, named, state, out, lse)


def _attention_varlen_bwd(names, lengths, options, deterministic, residuals, cotangents):
    # The lse leaves attention_varlen through stop_gradient: its cotangent is zero.
    q, k, v, cu_q, cu_k, named, state, out, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = buffer_callback(functools.partial(_varlen_backward_callback, lengths, *split_dropout(dict(options)),
                                             deterministic, names), shapes, vmap_method="sequential")
    dq, dk, dv = call(cotangents[0], q, k, v, out, lse, cu_q, cu_k, state, *named)
    return (dq, dk, dv, _no_cotangent(cu_q), _no_cotangent(cu_k), tuple(_operand_cotangent(x) for x in named),
            _no_cotangent(state))


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention_varlen_paged(q, k_cache, v_cache, cu_q, cu_k, named, state, names, lengths, options):
    return _varlen_forward_call(q, k_cache, v_cache, cu_q, cu_k, named, state, names, lengths, dict(options))


def _attention_varlen_paged_fwd(*args):
    return _attention_varlen_paged(*args), None


def _attention_varlen_paged_bwd(names, lengths, options, residuals, cotangents):
    raise NotImplementedError("cuflash.jax.attention_varlen: with block_table (a paged KV cache) there is a "
                              "forward only")


_attention_varlen_paged.defvjp(_attention_varlen_paged_fwd, _attention_varlen_paged_bwd)


def _int32_vector(name: str, x, size: int):
    if x.dtype != jnp.int32 or x.shape != (size,):
        raise ValueError(f"{name} must be an int32 array of shape ({size},), got {x.dtype} {x.shape}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                     dropout_p=0.0, dropout_key=None, block_table=None, seqused_q=None, seqused_k=None,
                     mask_alignment="bottom_right", return_lse=False):
    """`cuflash.attention_varlen` on JAX arrays inside `jax.jit`, differentiable in q, k and v.

    q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim); cu_seqlens_q and
    cu_seqlens_k int32 (batch + 1,) JAX arrays (their values are the caller's contract, as for
    device offsets in cuflash.attention_varlen); max_seqlen_q, max_seqlen_k: Python ints.
    alibi_slopes: float32 (nheads,) or (batch, nheads), as `attention`'s.
    dropout_p, dropout_key: as `attention`'s. `jax.vmap` runs one call per mapped element
    ("sequential").
    block_table: int32 (batch, max_pages); k and v are then a paged KV cache (num_pages,
    page_size, nheads_kv, headdim), as `cuflash.attention_varlen` takes it (chunked prefill;
    forward only: its gradient raises).
    seqused_q, seqused_k: int32 (batch,) JAX arrays, and mask_alignment, as cuflash.attention_varlen's;
    the rows past the used ones hold 0 in out and the gradients (-inf in the lse).
    return_lse: (out, lse), lse float32 (nheads, total_q), through jax.lax.stop_gradient.
    """
    _require_gpu_backend()
    k_rank = 3 if block_table is None else 4
    if q.ndim != 3 or k.ndim != k_rank or v.ndim != k_rank:
        raise ValueError(f"q must have 3 dims (total, nheads, headdim) and k and v {k_rank}, got shapes {q.shape}, "
                         f"{k.shape}, {v.shape}")
    _validate.head_shapes(q.shape, k.shape, v.shape)
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dtype != jnp.int32 or x.ndim != 1:
            raise ValueError(f"{name} must be an int32 array of shape (batch + 1,), got {x.dtype} {x.shape}")
    batch = cu_seqlens_q.shape[0] - 1
    lengths = (int(max_seqlen_q), int(max_seqlen_k))
    named = {"alibi_slopes": _alibi_operand(alibi_slopes, q.shape[1], batch), "block_table": block_table}
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is not None:
            named[name] = x = jnp.asarray(x)
            _int32_vector(name, x, batch)
    named = {name: x for name, x in named.items() if x is not None}
    top_left = _validate.mask_alignment(mask_alignment)
    return_lse = _validate.flag("return_lse", return_lse)
    p, state = dropout_state(dropout_p, dropout_key)
    options = (*option_items(causal, softmax_scale, window_size, softcap), ("mask_alignment", mask_alignment),
               ("dropout_p", p))
    if block_table is not None:
        if p:
            raise ValueError("dropout_p: the paged prefill takes no dropout")
        if seqused_q is not None or seqused_k is not None or top_left:
            raise NotImplementedError("seqused_q, seqused_k, mask_alignment: the paged prefill takes the cache "
                                      "lengths from cu_seqlens_k and aligns to the bottom right")
        out, lse = _attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, tuple(named.values()), state,
                                           tuple(named), lengths, options)
    else:
        out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, tuple(named.values()), state,
                                     tuple(named), lengths, options, _validate.flag("deterministic", deterministic))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# ---------------------------------------------------------------- KV cache

# The optional array arguments of attention_with_kvcache, in the order the callback receives them.
_KVCACHE_ARRAYS = ("k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "rotary_cos",
                   "rotary_sin", "alibi_slopes", "k_descale", "v_descale")


def _kvcache_callback(names, options, ctx, outputs, q, k_cache, v_cache, *arrays):
    # The caches' outputs alias their inputs: the append lands there.
    device_id = device_of(outputs[0], ctx.stream)
    out, k_out, v_out = (cupy_view(x, x.shape, device_id) for x in outputs)
    given = {name: cupy_view(x, x.shape, device_id) for name, x in zip(names, arrays)}
    with on_xla_stream(ctx, out):
        _kv_cache.attention_with_kvcache(cupy_view(q, q.shape, device_id), k_out, v_out, out=out, **given,
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
    options = dict(option_items(causal, softmax_scale, window_size, softcap))
    options.update(rotary_interleaved=_validate.flag("rotary_interleaved", rotary_interleaved),
                   num_splits=_validate.integer("num_splits", num_splits))
    arrays = dict(k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                  k_descale=k_descale, v_descale=v_descale)
    if isinstance(cache_seqlens, int):
        options["cache_seqlens"] = arrays.pop("cache_seqlens")
    names = tuple(name for name in _KVCACHE_ARRAYS if arrays.get(name) is not None)
    cache_dtype = k_cache.dtype
    k_cache, v_cache = _codes(k_cache), _codes(v_cache)
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k_cache, v_cache))
    call = buffer_callback(functools.partial(_kvcache_callback, names, options), shapes,
                           input_output_aliases={1: 1, 2: 2})
    out, k_cache, v_cache = call(q, k_cache, v_cache, *(arrays[name] for name in names))
    if cache_dtype == jnp.float8_e4m3fn:
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, cache_dtype) for c in (k_cache, v_cache))
    return out, k_cache, v_cache
