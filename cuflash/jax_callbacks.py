"""The buffer callbacks behind cuflash.jax: CuPy views of XLA's buffers, XLA's stream as CuPy's, and
the equal-length forward and backward calls that cuflash.jax and cuflash.jax_ring share.

A call's options travel as a dict of cuflash's keywords plus "dropout_p"; `split_dropout` takes p
out when the call is traced, and a callback adds dropout's seed words (a view of the state buffer
the call passes) only where p > 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy

from . import backward as _backward
from . import forward as _forward
from . import launch as _launch
from . import score_mods as _score_mods
from . import validate as _validate
from .device import OnExternalStream, cupy, memoised_external_array

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # JAX < 0.7
    buffer_callback = None


def option_items(causal, softmax_scale, window_size, softcap) -> tuple:
    """The options as hashable (name, value) pairs: custom_vjp's static arguments."""
    return (("causal", _validate.flag("causal", causal)), ("softmax_scale", softmax_scale),
            ("window_size", _validate.window_size(window_size, causal=False)), ("softcap", _validate.softcap(softcap)))


def dropout_state(dropout_p, dropout_key):
    """(dropout_p, the seed and offset words the kernels read) of a call: 4 uint32 drawn from
    dropout_key (jax.random.bits), zeros without dropout; the backward regenerates the mask from them."""
    p = _validate.dropout(dropout_p, 0, 0)[0]
    if p == 0:
        return p, jnp.zeros((_score_mods.DROPOUT_STATE_WORDS,), jnp.uint32)
    if dropout_key is None:
        raise ValueError("dropout_key: dropout_p > 0 needs a JAX random key (jax.random.key) to draw the mask from")
    return p, jax.random.bits(dropout_key, (_score_mods.DROPOUT_STATE_WORDS,), jnp.uint32)


def split_dropout(options: dict) -> tuple[dict, float]:
    """(cuflash's keywords without dropout_p, dropout_p) of a call's options, at trace time: the
    callbacks then copy no dict where p = 0."""
    return {name: value for name, value in options.items() if name != "dropout_p"}, options["dropout_p"]


def with_dropout(kwargs: dict, p: float, state, device_id: int) -> dict:
    """kwargs, and where p > 0 dropout's p and seed words (a view of the state buffer)."""
    if p == 0:
        return kwargs
    # Under jax.vmap the words are broadcast (or batched): every element takes the first's.
    words = cupy_view(state, (math.prod(state.shape) // _score_mods.DROPOUT_STATE_WORDS,
                              _score_mods.DROPOUT_STATE_WORDS), device_id)[0]
    return dict(kwargs, dropout_p=p, seed=words)


# (XLA stream, buffer address) -> the buffer's GPU.
_devices: dict = {}
_DEVICES_KEPT = 4096


def device_of(buffer, stream: int) -> int:
    """The GPU that holds an XLA buffer (under shard_map over several GPUs, the thread that runs a
    device's callback need not have that device current). Memoised on XLA's stream, which belongs
    to one device, and the address, which XLA hands again every step: pointerGetAttributes cost
    3.5-5.6 us a callback on the H100 host."""
    address = buffer.__cuda_array_interface__["data"][0]
    key = (stream, address)
    device = _devices.get(key)
    if device is None:
        if len(_devices) >= _DEVICES_KEPT:
            _devices.clear()
        device = _devices[key] = cupy().cuda.runtime.pointerGetAttributes(address).device
    return device


def cupy_view(buffer, shape, device_id: int):
    """A CuPy array over an XLA buffer on device_id (zero-copy), reshaped to `shape` (as many elements;
    e.g. leading vmapped dims merged into the batch).

    Built from the buffer's address and memoised: a DLPack import cost ~5 us a buffer on the H100
    host, plus its release when the callback returns. A buffer with strides of its own (XLA's are
    row-major) goes through DLPack."""
    interface = buffer.__cuda_array_interface__
    if interface.get("strides") is not None:
        return cupy().from_dlpack(buffer).reshape(shape)
    return memoised_external_array(interface["data"][0], tuple(shape), None, buffer.dtype, device_id)


def batch_shape(x, rank: int = 4) -> tuple:
    """x's shape with any leading (vmapped) dims merged into the first of its last `rank` dims."""
    lead = len(x.shape) - rank + 1
    return (math.prod(x.shape[:lead]), *x.shape[lead:])


def on_xla_stream(ctx, array) -> OnExternalStream:
    """`with on_xla_stream(ctx, array):` XLA's stream as CuPy's current one, with the device of
    `array` (a view of one of the callback's buffers) current: under shard_map over several GPUs,
    the thread that runs a device's callback need not have that device current."""
    return OnExternalStream(array.device, ctx.stream)


def operands(slopes) -> tuple:
    """The optional slopes as trailing callback operands."""
    return () if slopes is None else (slopes,)


def slopes_view(slopes: tuple, batch: int, device_id: int):
    """The callback's slopes operand (if any) as cuflash takes it for a call of `batch` rows: (nheads,)
    or (batch, nheads). Under jax.vmap ("broadcast_all") the buffer gains the mapped dims in front:
    slopes of shape (batch, nheads) merge them into the batch; slopes of shape (nheads,) become a row
    per mapped element, repeated over the element's own batch (a copy on the current stream)."""
    if not slopes:
        return None
    (buffer,) = slopes
    nheads = buffer.shape[-1]
    rows = math.prod(buffer.shape[:-1])
    view = cupy_view(buffer, (rows, nheads) if rows > 1 else (nheads,), device_id)
    if rows <= 1 or rows == batch:
        return view
    return cupy().repeat(view, batch // rows, axis=0)


def _named_operands(names: tuple, buffers: tuple, batch: int, device_id: int) -> dict:
    """A forward callback's trailing operands as cuflash's keywords: alibi_slopes (slopes_view) and
    fp8's descales ((batch, nheads_kv), vmapped dims merged into the batch)."""
    return {name: slopes_view((x,), batch, device_id) if name == "alibi_slopes"
            else cupy_view(x, batch_shape(x, 2), device_id) for name, x in zip(names, buffers)}


def _forward_callback(kwargs, p, names, ctx, outputs, q, k, v, state, *named):
    out, lse = outputs
    device_id = device_of(out, ctx.stream)
    qc, kc, vc = (cupy_view(x, batch_shape(x), device_id) for x in (q, k, v))
    with on_xla_stream(ctx, qc):
        _forward.attention(qc, kc, vc, out=cupy_view(out, batch_shape(out), device_id),
                           lse=cupy_view(lse, batch_shape(lse, 3), device_id),
                           **_named_operands(names, named, qc.shape[0], device_id),
                           **with_dropout(kwargs, p, state, device_id))


def _backward_callback(kwargs, p, deterministic, ctx, outputs, dout, q, k, v, out, lse, state, *slopes):
    *grads, scratch = outputs
    device_id = device_of(scratch, ctx.stream)
    dq, dk, dv = (cupy_view(x, batch_shape(x), device_id) for x in grads)
    inputs = [cupy_view(x, batch_shape(x), device_id) for x in (dout, q, k, v, out)]
    with on_xla_stream(ctx, dq):
        workspace = _launch.BackwardWorkspace(0, device_id, cupy_view(scratch, (math.prod(scratch.shape),), device_id))
        _backward.attention_backward(*inputs, cupy_view(lse, batch_shape(lse, 3), device_id), dq=dq, dk=dk,
                                     dv=dv, deterministic=deterministic, workspace=workspace,
                                     alibi_slopes=slopes_view(slopes, dq.shape[0], device_id),
                                     **with_dropout(kwargs, p, state, device_id))


def forward_call(q, k, v, state, options: dict, slopes=None, descales: dict | None = None, out_dtype=None):
    """(out, lse) of cuflash.attention on JAX arrays (options: cuflash's keywords and dropout_p).
    slopes and fp8's descales (name -> array) go as trailing operands; out is of q's dtype unless
    out_dtype is given (fp8: bfloat16, q, k and v their uint8 codes)."""
    named = {} if slopes is None else {"alibi_slopes": slopes}
    named.update(descales or {})
    batch, seqlen_q, nheads, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype),
              jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32))
    call = buffer_callback(functools.partial(_forward_callback, *split_dropout(options), tuple(named)), shapes,
                           vmap_method="broadcast_all")
    return call(q, k, v, state, *named.values())


def backward_call(dout, q, k, v, out, lse, state, options: dict, deterministic: bool, slopes=None):
    """(dq, dk, dv) of cuflash.attention_backward on JAX arrays."""
    # The backward's scratch is one more output, so that XLA owns it: no allocation in the call.
    batch = int(numpy.prod(q.shape[:-3]))  # vmapped dims merge into the batch
    floats = _backward.workspace_floats((batch, *q.shape[-3:]), (batch, *k.shape[-3:]), q.dtype,
                                        alibi=slopes is not None, deterministic=deterministic,
                                        device_id=cupy().cuda.Device().id,
                                        **{name: options[name] for name in ("causal", "window_size", "softcap")})
    shapes = (*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
              jax.ShapeDtypeStruct((max(floats, 1),), jnp.float32))
    call = buffer_callback(functools.partial(_backward_callback, *split_dropout(options), deterministic), shapes,
                           vmap_method="broadcast_all")
    return call(dout, q, k, v, out, lse, state, *operands(slopes))[:3]
