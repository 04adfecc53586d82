"""Run by tests/test_jax_ring.py in a process of its own with 4 CPU devices (XLA_FLAGS): cuflash.jax_ring's
ring under shard_map, each step computed by the jnp attention below, against the jnp attention over the
whole sequence, forward and gradients. Exits non-zero on a mismatch."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cuflash import distributed, jax_ring

jax.config.update("jax_enable_x64", True)
SCALE = 0.3


def scores(q, k, causal, softmax_scale):
    group = q.shape[2] // k.shape[2]
    s = softmax_scale * jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2))
    nq, nk = q.shape[1], k.shape[1]
    visible = jnp.arange(nk)[None, :] <= jnp.arange(nq)[:, None] + nk - nq
    return jnp.where(visible, s, -jnp.inf) if causal else s


def attention(q, k, v, causal, softmax_scale, softcap=0.0):
    assert softcap == 0.0, "no softcap in this jnp attention"
    s = scores(q, k, causal, softmax_scale)
    lse = jax.nn.logsumexp(s, axis=-1)
    group = q.shape[2] // k.shape[2]
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), jnp.repeat(v, group, axis=2)), lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, softcap=0.0):
    """A shard pair's gradients given the whole rows' out and lse."""
    assert softcap == 0.0, "no softcap in this jnp attention"
    group = q.shape[2] // k.shape[2]
    p = jnp.exp(scores(q, k, causal, softmax_scale) - lse[..., None])
    vr, kr = jnp.repeat(v, group, axis=2), jnp.repeat(k, group, axis=2)
    dp = jnp.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - jnp.einsum("bqhd,bqhd->bhq", dout, out)[..., None])
    dq = softmax_scale * jnp.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = softmax_scale * jnp.einsum("bhqk,bqhd->bkhd", ds, q)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[3]).sum(axis=3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def check(world, layout, causal, nheads_kv):
    mesh = jax.make_mesh((world,), ("sp",), devices=jax.devices()[:world])
    rng = np.random.default_rng(world)
    n = 8 * world
    q = jnp.asarray(rng.standard_normal((2, n, 4, 8)))
    k, v = (jnp.asarray(rng.standard_normal((2, n, nheads_kv, 8))) for _ in range(2))
    dout = jnp.asarray(rng.standard_normal(q.shape))
    order = np.concatenate([distributed.shard_positions(n, r, world, layout) for r in range(world)])

    ring = jax.shard_map(functools.partial(jax_ring.ring_attention, axis_name="sp", causal=causal, layout=layout,
                                           softmax_scale=SCALE, local=(attention, backward)),
                         mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    sharded = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v, dout)]
    got = jax.jit(ring)(*sharded[:3])
    want = attention(q, k, v, causal, SCALE)[0]
    np.testing.assert_allclose(got, want[:, order], atol=1e-10)

    grads = jax.jit(jax.grad(lambda *x: jnp.sum(ring(*x) * sharded[3]), argnums=(0, 1, 2)))(*sharded[:3])
    wants = jax.grad(lambda *x: jnp.sum(attention(*x, causal, SCALE)[0] * dout), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", grads, wants):
        np.testing.assert_allclose(g, w[:, order], atol=1e-10, err_msg=f"d{name}")
    print(f"world {world} {layout} causal={causal} nheads_kv={nheads_kv}: forward and gradients match")


if __name__ == "__main__":
    for world, layout, causal, nheads_kv in ((1, "zigzag", True, 4), (2, "zigzag", True, 2), (3, "zigzag", True, 4),
                                             (4, "zigzag", True, 1), (4, "zigzag", False, 2),
                                             (3, "contiguous", True, 2)):
        check(world, layout, causal, nheads_kv)
    sys.exit(0)
