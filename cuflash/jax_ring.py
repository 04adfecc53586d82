"""Ring attention in JAX: `cuflash.distributed`'s algorithm inside `shard_map`, with
`jax.lax.ppermute` as the transport and cuflash's kernels (`cuflash.jax`) as each step's.

    from jax.sharding import PartitionSpec as P
    from cuflash import distributed, jax_ring

    order = numpy.concatenate([distributed.shard_positions(n, r, R) for r in range(R)])
    ring = jax.shard_map(functools.partial(jax_ring.ring_attention, axis_name="sp", causal=True),
                         mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    out = ring(q[:, order], k[:, order], v[:, order])   # out[:, order] of the whole attention

Inside `shard_map` a rank's index is traced, so each step picks its shard pair's call with
`lax.switch`: the zigzag layout's three cases (the source's shard before, after or equal to this
rank's; `cuflash.distributed` explains them) return the rank's rows padded to its shard, with
lse -inf on rows the step does not touch. The gradient is a `custom_vjp` of the whole ring: the
backward runs the steps again with the saved out and lse, and dK, dV travel with their shards
for a full turn back to their owners.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from . import distributed
from .jax import _backward_call, _forward_call, _option_items


def _kernels(causal_options: dict):
    """Each step's kernels on the GPU: (forward, backward) as the ring calls them."""
    def forward(q, k, v, causal):
        return _forward_call(q, k, v, {**causal_options, "causal": causal})

    def backward(dout, q, k, v, out, lse, causal):
        return _backward_call(dout, q, k, v, out, lse, {**causal_options, "causal": causal}, False)

    return forward, backward


def _pad_rows(x, before: int, axis: int, fill):
    """x with `before` rows of `fill` put in front along `axis`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (before, 0)
    return jnp.pad(x, pad, constant_values=fill)


def _case(rank, source, causal: bool, layout: str):
    """The lax.switch index of a step: 0 the rank's own shard (causal), 1 a source before it (the
    source's first chunk seen whole), 2 a source after it (zigzag: only the second query chunk, the
    whole shard; contiguous: nothing), 3 no mask at all."""
    if not causal:
        return jnp.int32(3)
    return jnp.where(source == rank, 0, jnp.where(source < rank, 1, 2)).astype(jnp.int32)


def _forward_branches(local_fwd: Callable, n_local: int, layout: str, axis_name):
    half = n_local // 2

    def empty(q):  # typed as varying over the ring's axis, as the other branches' results are
        return jax.lax.pcast((jnp.zeros(q.shape, q.dtype),
                              jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, _accumulator_dtype(q))),
                             axis_name, to="varying")

    def own(q, k, v):
        return local_fwd(q, k, v, True)

    def before(q, k, v):
        if layout == "contiguous":
            return local_fwd(q, k, v, False)
        return local_fwd(q, k[:, :half], v[:, :half], False)

    def after(q, k, v):
        if layout == "contiguous":
            return empty(q)
        out, lse = local_fwd(q[:, half:], k, v, False)
        return _pad_rows(out, half, 1, 0), _pad_rows(lse, half, 2, -jnp.inf)

    def whole(q, k, v):
        return local_fwd(q, k, v, False)

    return [own, before, after, whole]


def _backward_branches(local_bwd: Callable, n_local: int, layout: str, axis_name):
    half = n_local // 2

    def own(dout, q, k, v, out, lse):
        return local_bwd(dout, q, k, v, out, lse, True)

    def before(dout, q, k, v, out, lse):
        if layout == "contiguous":
            return local_bwd(dout, q, k, v, out, lse, False)
        dq, dk, dv = local_bwd(dout, q, k[:, :half], v[:, :half], out, lse, False)
        pad = [(0, 0), (0, half), (0, 0), (0, 0)]
        return dq, jnp.pad(dk, pad), jnp.pad(dv, pad)

    def after(dout, q, k, v, out, lse):
        if layout == "contiguous":
            return jax.lax.pcast((jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                                  jnp.zeros(v.shape, v.dtype)), axis_name, to="varying")
        rows = slice(half, None)
        dq, dk, dv = local_bwd(dout[:, rows], q[:, rows], k, v, out[:, rows], lse[:, :, rows], False)
        return _pad_rows(dq, half, 1, 0), dk, dv

    def whole(dout, q, k, v, out, lse):
        return local_bwd(dout, q, k, v, out, lse, False)

    return [own, before, after, whole]


def _accumulator_dtype(x):
    """float32 for 16-bit shards, the shards' own dtype where it is wider."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _merge(out_acc, lse_acc, out, lse):
    """The running (out, lse) merged with a step's by log-sum-exp (rows at -inf add nothing)."""
    new = jnp.logaddexp(lse_acc, lse)
    finite = jnp.isfinite(new)
    safe = jnp.where(finite, new, 0.0)
    w_old = jnp.where(finite, jnp.exp(lse_acc - safe), 0.0).transpose(0, 2, 1)[..., None]
    w_new = jnp.where(finite, jnp.exp(lse - safe), 0.0).transpose(0, 2, 1)[..., None]
    return out_acc * w_old + out.astype(out_acc.dtype) * w_new, new.astype(lse_acc.dtype)


def _ring_forward(q, k, v, axis_name, causal, layout, local):
    world = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    ring = [(i, (i + 1) % world) for i in range(world)]
    branches = _forward_branches(local[0], q.shape[1], layout, axis_name)
    acc = _accumulator_dtype(q)
    out = jnp.zeros(q.shape, acc)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, acc)
    for t in range(world):
        source = (rank - t) % world
        step_out, step_lse = jax.lax.switch(_case(rank, source, causal, layout), branches, q, k, v)
        out, lse = _merge(out, lse, step_out, step_lse)
        if t + 1 < world:
            k, v = jax.lax.ppermute((k, v), axis_name, ring)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, axis_name, causal, layout, local):
    return _ring_forward(q, k, v, axis_name, causal, layout, local)


def _ring_fwd(q, k, v, axis_name, causal, layout, local):
    out, lse = _ring_forward(q, k, v, axis_name, causal, layout, local)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(axis_name, causal, layout, local, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout = cotangents[0]  # lse is an output for the caller, not differentiated through
    world = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    ring = [(i, (i + 1) % world) for i in range(world)]
    branches = _backward_branches(local[1], q.shape[1], layout, axis_name)
    acc = _accumulator_dtype(q)
    dq = jnp.zeros(q.shape, acc)
    dk, dv = jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)
    for t in range(world):
        source = (rank - t) % world
        dq_s, dk_s, dv_s = jax.lax.switch(_case(rank, source, causal, layout), branches, dout, q, k, v, out, lse)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
        if t + 1 < world:
            k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axis_name, ring)
    dk, dv = jax.lax.ppermute((dk, dv), axis_name, ring)  # the world-th hop: home to their owners
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name, causal=False, softmax_scale=None, softcap=0.0, layout="zigzag",
                   return_lse=False, local: tuple | None = None):
    """Exact attention over the shards of `axis_name` (call inside `shard_map`); q, k, v are this
    rank's shards (batch, n_local, heads, headdim) in `layout` (`cuflash.distributed.shard_positions`).

    Differentiable. local: (forward(q, k, v, causal) -> (out, lse), backward(dout, q, k, v, out, lse,
    causal) -> (dq, dk, dv)) replaces cuflash's kernels (the tests run the ring on CPU devices).
    """
    distributed._check_layout(layout)
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q: a zigzag shard holds two equal chunks; its length must be even, got {q.shape[1]}")
    if local is None:
        options = dict(_option_items(False, softmax_scale, None, softcap))
        options.pop("causal")
        local = _kernels(options)
    out, lse = _ring(q, k, v, axis_name, bool(causal), layout, local)
    return (out, lse.astype(jnp.float32)) if return_lse else out
