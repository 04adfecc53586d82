"""Ring attention in JAX: `cuflash.distributed`'s algorithm inside `shard_map`, with
`jax.lax.ppermute` as the transport and cuflash's kernels (`cuflash.jax_callbacks`) as each step's.

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
from . import validate as _validate
from .jax_callbacks import backward_call, dropout_state, forward_call, option_items


def _kernel_options(causal, softmax_scale, softcap) -> dict:
    """cuflash.jax's call options of one step: no window, no dropout."""
    return dict(option_items(causal, softmax_scale, None, softcap), dropout_p=0.0)


def _kernel_forward(q, k, v, *, causal, softmax_scale, softcap):
    _, state = dropout_state(0.0, None)
    return forward_call(q, k, v, state, _kernel_options(causal, softmax_scale, softcap))


def _kernel_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, softcap):
    _, state = dropout_state(0.0, None)
    return backward_call(dout, q, k, v, out, lse, state, _kernel_options(causal, softmax_scale, softcap), False)


def _bound(local: tuple, softmax_scale, softcap) -> tuple:
    """(forward(q, k, v, causal), backward(dout, q, k, v, out, lse, causal)) with the options bound."""
    options = dict(softmax_scale=softmax_scale, softcap=softcap)
    forward, backward = local
    return (lambda q, k, v, causal: forward(q, k, v, causal=causal, **options),
            lambda dout, q, k, v, out, lse, causal: backward(dout, q, k, v, out, lse, causal=causal, **options))


def _pad_rows(x, axis: int, before: int, after: int, fill=0):
    """x padded with `before` and `after` rows of `fill` along `axis`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (before, after)
    return jnp.pad(x, pad, constant_values=fill)


def _steps(n_local: int, causal: bool, layout: str) -> list:
    """The distinct steps a rank takes (cuflash.distributed.ring_step, None: nothing visible), in
    the order of `_case`: its own shard, a source before it and a source after it (causal), or
    the one unmasked step."""
    if not causal:
        return [distributed.ring_step(0, 1, n_local, False, layout)]
    return [distributed.ring_step(rank, source, n_local, True, layout) for rank, source in ((0, 0), (1, 0), (0, 1))]


def _case(rank, source, causal: bool):
    """The step of `_steps` a rank takes against `source`'s shard (both traced)."""
    if not causal:
        return jnp.int32(0)
    return jnp.where(source == rank, 0, jnp.where(source < rank, 1, 2)).astype(jnp.int32)


def _accumulator_dtype(x):
    """float32 for 16-bit shards, the shards' own dtype where it is wider."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _forward_branch(step, local_fwd: Callable, axis_name):
    """A step's (out, lse) over all of the rank's rows (rows the step does not take: 0 and -inf)."""
    def branch(q, k, v):
        n = q.shape[1]
        if step is None:  # typed as varying over the ring's axis, as the other branches' results are
            return jax.lax.pcast((jnp.zeros(q.shape, q.dtype),
                                  jnp.full((q.shape[0], q.shape[2], n), -jnp.inf, _accumulator_dtype(q))),
                                 axis_name, to="varying")
        keys = slice(step.k0, step.k1)
        out, lse = local_fwd(q[:, step.q0:step.q1], k[:, keys], v[:, keys], step.causal)
        return (_pad_rows(out, 1, step.q0, n - step.q1),
                _pad_rows(lse, 2, step.q0, n - step.q1, -jnp.inf))

    return branch


def _backward_branch(step, local_bwd: Callable, axis_name):
    """A step's (dq, dk, dv) over the rank's whole shards (zero where the step does not reach)."""
    def branch(dout, q, k, v, out, lse):
        n = q.shape[1]
        if step is None:
            return jax.lax.pcast((jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                                  jnp.zeros(v.shape, v.dtype)), axis_name, to="varying")
        rows, keys = slice(step.q0, step.q1), slice(step.k0, step.k1)
        dq, dk, dv = local_bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                               step.causal)
        return (_pad_rows(dq, 1, step.q0, n - step.q1), _pad_rows(dk, 1, step.k0, n - step.k1),
                _pad_rows(dv, 1, step.k0, n - step.k1))

    return branch


def _ring_of(axis_name):
    """(ranks on the axis, this rank (traced), ppermute's pairs: each rank sends to the next)."""
    world = jax.lax.axis_size(axis_name)
    return world, jax.lax.axis_index(axis_name), [(i, (i + 1) % world) for i in range(world)]


def _ring_forward(q, k, v, axis_name, causal, layout, local):
    world, rank, ring = _ring_of(axis_name)
    branches = [_forward_branch(step, local[0], axis_name) for step in _steps(q.shape[1], causal, layout)]
    acc = _accumulator_dtype(q)
    out = jnp.zeros(q.shape, acc)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, acc)
    for t in range(world):
        source = (rank - t) % world
        step_out, step_lse = jax.lax.switch(_case(rank, source, causal), branches, q, k, v)
        out, lse = distributed.lse_merge(jnp, out, lse, step_out, step_lse)
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
    world, rank, ring = _ring_of(axis_name)
    branches = [_backward_branch(step, local[1], axis_name) for step in _steps(q.shape[1], causal, layout)]
    acc = _accumulator_dtype(q)
    dq = jnp.zeros(q.shape, acc)
    dk, dv = jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)
    for t in range(world):
        source = (rank - t) % world
        dq_s, dk_s, dv_s = jax.lax.switch(_case(rank, source, causal), branches, dout, q, k, v, out, lse)
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

    Differentiable in q, k and v; the lse (with return_lse) carries no gradient (a loss that
    reads it gets none through it). local: (forward(q, k, v, *, causal, softmax_scale, softcap)
    -> (out, lse), backward(dout, q, k, v, out, lse, *, causal, softmax_scale, softcap) -> (dq, dk,
    dv)) replaces cuflash's kernels (the tests run the ring on CPU devices).
    """
    distributed.check_layout(layout)
    distributed.check_shard_length(q.shape[1], causal, layout)
    local = _bound(local or (_kernel_forward, _kernel_backward), softmax_scale, softcap)
    out, lse = _ring(q, k, v, axis_name, _validate.flag("causal", causal), layout, local)
    return (out, jax.lax.stop_gradient(lse).astype(jnp.float32)) if return_lse else out
