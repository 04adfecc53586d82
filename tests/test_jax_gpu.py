"""cuflash.jax: attention inside jax.jit, with gradients, vmap and remat, against cuflash.reference
(2x rule) and the eager CuPy path (bitwise)."""

import os

import numpy as np
import pytest

from cuflash import reference
from tests.numerics import (ATOL, assert_close_2x, e4m3_kvcache_step, jax_nn_mask, mentions, paged_prefill_case,
                            randn, ring_rounding)

# JAX would otherwise take 75% of the GPU's memory when it starts, from tests that share the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_backend():
    if jax.default_backend() != "gpu":
        pytest.skip("JAX sees no GPU")


def inputs(rng, dtype=np.float16, batch=2, nq=197, nk=300, nheads=4, nheads_kv=2, headdim=64):
    host = [randn(rng, (batch, n, h, headdim), dtype) for n, h in ((nq, nheads), (nk, nheads_kv), (nk, nheads_kv))]
    dout = randn(rng, (batch, nq, nheads, headdim), dtype)
    return host, dout


def jitted_value_and_grads(fn, q, k, v, dout):
    """fn(q, k, v) and the gradients of sum(out * dout) (in fp32) in q, k and v, under jax.jit."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(32, 8), softcap=3.0), {}])
def test_jit_forward_and_grad_match_reference_and_eager(rng, options):
    import cupy

    import cuflash
    import cuflash.jax

    host, dout = inputs(rng)
    q, k, v = (jnp.asarray(x) for x in host)

    def loss(q, k, v):
        out = cuflash.jax.attention(q, k, v, deterministic=True, **options)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    ref = reference.attention(*host, **options)
    naive = reference.attention_naive_lowp(*host, dtype=np.float16, **options)
    assert_close_2x(np.asarray(out), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_backward(dout, *host, **options)
    naives = reference.attention_backward_naive_lowp(dout, *host, dtype=np.float16, **options)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, ATOL[np.dtype(np.float16)])

    dev = [cupy.asarray(x) for x in host]
    eager_out, eager_lse = cuflash.attention(*dev, return_lse=True, **options)
    eager_grads = cuflash.attention_backward(cupy.asarray(dout), *dev, eager_out, eager_lse, deterministic=True,
                                             **options)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), eager_out.get().view(np.uint16))
    for g, e in zip(grads, eager_grads):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), e.get().view(np.uint16))


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_jit_alibi_matches_reference_and_eager(rng, slopes_shape):
    """alibi_slopes with softcap and the causal mask under jax.jit: forward and gradients against the
    reference (2x rule) and the eager CuPy calls (bitwise); the slopes' cotangent is zero."""
    import cupy

    import cuflash
    import cuflash.jax

    host, dout = inputs(rng)
    slopes_host = rng.uniform(0.01, 0.5, slopes_shape).astype(np.float32)
    q, k, v = (jnp.asarray(x) for x in host)
    options = dict(causal=True, softcap=2.5)

    def loss(q, k, v, slopes):
        out = cuflash.jax.attention(q, k, v, alibi_slopes=slopes, deterministic=True, **options)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.asarray(slopes_host))
    assert not np.asarray(grads[3]).any()
    refs_opts = dict(options, alibi_slopes=slopes_host)
    atol = ATOL[np.dtype(np.float16)]
    assert_close_2x(np.asarray(out), reference.attention(*host, **refs_opts),
                    reference.attention_naive_lowp(*host, dtype=np.float16, **refs_opts), atol)
    refs = reference.attention_backward(dout, *host, **refs_opts)
    naives = reference.attention_backward_naive_lowp(dout, *host, dtype=np.float16, **refs_opts)
    for g, r, n in zip(grads[:3], refs, naives):
        assert_close_2x(np.asarray(g), r, n, atol)

    dev = [cupy.asarray(x) for x in host]
    eager_opts = dict(options, alibi_slopes=cupy.asarray(slopes_host))
    eager_out, eager_lse = cuflash.attention(*dev, return_lse=True, **eager_opts)
    eager_grads = cuflash.attention_backward(cupy.asarray(dout), *dev, eager_out, eager_lse, deterministic=True,
                                             **eager_opts)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), eager_out.get().view(np.uint16))
    for g, e in zip(grads, eager_grads):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), e.get().view(np.uint16))


def test_bad_alibi_slopes_are_named(rng):
    import cuflash.jax

    host, _ = inputs(rng)
    q, k, v = (jnp.asarray(x) for x in host)
    for bad, error in ((jnp.ones((3,), jnp.float32), ValueError), (jnp.ones((4,), jnp.float16), TypeError),
                       (jnp.ones((3, 4), jnp.float32), ValueError)):
        with pytest.raises(error, match="alibi_slopes"):
            cuflash.jax.attention(q, k, v, alibi_slopes=bad)


def test_bad_shapes_and_options_are_named_while_tracing():
    """Checked when traced, before the backward is sized (which divides by nheads_kv): k's heads, head
    dim and batch against q's, v against k, window_size a pair of ints (not truncated), flags bools."""
    import cuflash.jax

    q = jnp.zeros((2, 8, 4, 64), jnp.float16)

    def grad(k, v, **options):
        return jax.jit(jax.grad(lambda q: cuflash.jax.attention(q, k, v, **options).astype(jnp.float32).sum()))(q)

    for shape, match in (((2, 8, 0, 64), "nheads_kv"), ((2, 8, 3, 64), "nheads_kv"), ((2, 8, 2, 32), "head dim"),
                         ((1, 8, 2, 64), "batch size")):
        k = jnp.zeros(shape, jnp.float16)
        with pytest.raises(ValueError, match=match):
            grad(k, k)
    k = jnp.zeros((2, 8, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match=mentions("v")):
        grad(k, k[:, :4])
    cu = jnp.asarray([0, 8], jnp.int32)
    with pytest.raises(ValueError, match="nheads_kv"):
        cuflash.jax.attention_varlen(q[0], k[0, :, :0], k[0, :, :0], cu, cu, 8, 8)
    for window in ((16, 2, 99), (16.9, 2)):
        with pytest.raises(TypeError, match="window_size"):
            grad(k, k, window_size=window)
    with pytest.raises(TypeError, match="causal"):
        grad(k, k, causal="False")


def test_vmap_alibi_slopes_follow_each_element(rng):
    """jax.vmap over calls of batch 2 with ALiBi: slopes of shape (nheads,) shared by the elements
    (broadcast, then repeated over each element's batch) or mapped with them; each element's output
    and gradients equal its own call's, bitwise."""
    import cuflash.jax

    stacks = [inputs(np.random.default_rng(seed), batch=2, nq=65, nk=97)[0] for seed in range(3)]
    q, k, v = (jnp.asarray(np.stack([s[i] for s in stacks])) for i in range(3))
    slopes = jnp.asarray(rng.uniform(0.01, 0.5, (3, 4)).astype(np.float32))

    def value_and_grads(q, k, v, slopes):
        def loss(q, k, v):
            out = cuflash.jax.attention(q, k, v, alibi_slopes=slopes, causal=True, deterministic=True)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, *grads

    for in_axes, pick in (((0, 0, 0, None), lambda i: slopes[0]), ((0, 0, 0, 0), lambda i: slopes[i])):
        shared = slopes[0] if in_axes[3] is None else slopes
        mapped = jax.jit(jax.vmap(value_and_grads, in_axes=in_axes))(q, k, v, shared)
        for i in range(len(stacks)):
            own = jax.jit(value_and_grads)(q[i], k[i], v[i], pick(i))
            for a, b in zip(mapped, own):
                np.testing.assert_array_equal(np.asarray(a[i]).view(np.uint16), np.asarray(b).view(np.uint16))


def test_e4m3_forward_in_jit(rng):
    """float8_e4m3fn q, k, v with descales under jax.jit, and under jax.vmap: the bf16 output of
    cuflash.attention on the codes, bitwise; no backward, mixed dtypes and 16-bit descales refused
    by name."""
    import cupy
    import ml_dtypes

    import cuflash
    import cuflash.jax

    quantised = [reference.fp8_quantize(randn(rng, (2, n, 2, 64), np.float32)) for n in (97, 130, 130)]
    codes = [jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn)) for bits, _ in quantised]
    names = ("q_descale", "k_descale", "v_descale")
    descales = {name: jnp.asarray(d) for name, (_, d) in zip(names, quantised)}
    options = dict(causal=True, softcap=3.0, window_size=(40, 0))
    expected = cuflash.attention(*(cupy.asarray(bits) for bits, _ in quantised), **options,
                                 **{name: cupy.asarray(d) for name, (_, d) in zip(names, quantised)})
    expected = expected.get().view(np.uint16)

    def call(q, k, v, descales):
        return cuflash.jax.attention(q, k, v, **options, **descales)

    out = jax.jit(call)(*codes, descales)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), expected)
    stacked = [jnp.stack([x, x]) for x in codes]
    mapped = jax.jit(jax.vmap(call))(*stacked, {name: jnp.stack([d, d]) for name, d in descales.items()})
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(mapped[i]).view(np.uint16), expected)
    with pytest.raises(NotImplementedError, match="fp8"):
        jax.grad(lambda q: call(q, *codes[1:], descales).astype(jnp.float32).sum())(codes[0])
    half = jnp.zeros((2, 130, 2, 64), jnp.float16)
    with pytest.raises(TypeError, match=mentions("k")):
        cuflash.jax.attention(codes[0], half, codes[2])
    with pytest.raises(ValueError, match="q_descale"):
        cuflash.jax.attention(half, half, half, q_descale=descales["q_descale"])


def test_vmap_merges_the_mapped_axis_into_the_batch(rng):
    import cuflash.jax

    stacks = [inputs(np.random.default_rng(seed), batch=1, nq=65, nk=65)[0] for seed in range(3)]
    q, k, v = (jnp.asarray(np.stack([s[i] for s in stacks])) for i in range(3))
    out = jax.jit(jax.vmap(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True)))(q, k, v)
    for i, host in enumerate(stacks):
        ref = reference.attention(*host, causal=True)
        naive = reference.attention_naive_lowp(*host, causal=True, dtype=np.float16)
        assert_close_2x(np.asarray(out[i]), ref, naive, ATOL[np.dtype(np.float16)])
    shared = jax.vmap(lambda q: cuflash.jax.attention(q, k[0], v[0]))(q)  # k, v broadcast
    ref = reference.attention(stacks[1][0], stacks[0][1], stacks[0][2])
    naive = reference.attention_naive_lowp(stacks[1][0], stacks[0][1], stacks[0][2], dtype=np.float16)
    assert_close_2x(np.asarray(shared[1]), ref, naive, ATOL[np.dtype(np.float16)])


def test_vmap_of_grad_sizes_the_workspace_for_the_merged_batch(rng):
    """jax.vmap of jax.grad: the backward's scratch (an XLA output) is batched with the mapped axis and
    covers the merged batch; each element's gradients equal those of its own call, bitwise."""
    import cuflash.jax

    stacks = [inputs(np.random.default_rng(seed), batch=1, nq=97, nk=130)[0] for seed in range(3)]
    q, k, v = (jnp.asarray(np.stack([s[i] for s in stacks])) for i in range(3))

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(cuflash.jax.attention(q, k, v, causal=True, deterministic=True)
                                       .astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    mapped = jax.jit(jax.vmap(grads))(q, k, v)
    for i in range(len(stacks)):
        own = jax.jit(grads)(q[i], k[i], v[i])
        for a, b in zip(mapped, own):
            np.testing.assert_array_equal(np.asarray(a[i]).view(np.uint16), np.asarray(b).view(np.uint16))


def test_grad_under_checkpoint(rng):
    import cuflash.jax

    host, dout = inputs(rng, dtype=np.float16, nq=128, nk=128)
    q, k, v = (jnp.asarray(x) for x in host)

    @jax.checkpoint
    def block(q, k, v):
        return cuflash.jax.attention(q, k, v, causal=True, deterministic=True)

    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(block(q, k, v).astype(jnp.float32) * dout.astype(np.float32)),
                             argnums=(0, 1, 2)))(q, k, v)
    refs = reference.attention_backward(dout, *host, causal=True)
    naives = reference.attention_backward_naive_lowp(dout, *host, causal=True, dtype=np.float16)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, ATOL[np.dtype(np.float16)])


@pytest.mark.parametrize("alibi", [False, True])
def test_varlen_in_jit_with_grad(rng, alibi):
    import cuflash.jax

    lengths = [17, 0, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    host = [randn(rng, (total, 4, 64), np.float16), randn(rng, (total, 2, 64), np.float16),
            randn(rng, (total, 2, 64), np.float16)]
    dout = randn(rng, (total, 4, 64), np.float16)
    q, k, v = (jnp.asarray(x) for x in host)
    cu_dev = jnp.asarray(cu)
    slopes_host = rng.uniform(0.01, 0.5, (4,)).astype(np.float32) if alibi else None
    slopes = None if slopes_host is None else jnp.asarray(slopes_host)

    def loss(q, k, v):
        out = cuflash.jax.attention_varlen(q, k, v, cu_dev, cu_dev, 130, 130, causal=True, alibi_slopes=slopes)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    options = dict(causal=True, alibi_slopes=slopes_host)
    ref = reference.attention_varlen(*host, cu, cu, **options)
    naive = reference.attention_varlen_naive_lowp(*host, cu, cu, dtype=np.float16, **options)
    assert_close_2x(np.asarray(out), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_varlen_backward(dout, *host, cu, cu, **options)
    naives = reference.attention_varlen_backward_naive_lowp(dout, *host, cu, cu, dtype=np.float16, **options)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, ATOL[np.dtype(np.float16)])


def test_varlen_paged_in_jit(rng):
    """block_table (chunked prefill over a paged cache) inside jit: bitwise equal to
    cuflash.attention_varlen on the same arrays; its gradient raises."""
    import cupy

    import cuflash.jax

    options = dict(window_size=(40, 0), alibi_slopes=rng.uniform(0.01, 0.3, (4,)).astype(np.float32))
    case, expected, _ = paged_prefill_case(rng, **{n: cupy.asarray(x) if isinstance(x, np.ndarray) else x
                                                  for n, x in options.items()})
    q, k_pages, v_pages, cu_q, cu_k, table = (jnp.asarray(x) for x in (case["q"], *case["pages"], *case["cu"],
                                                                        case["table"]))

    def call(q):
        return cuflash.jax.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, *case["lengths"], block_table=table,
                                            **options)

    np.testing.assert_array_equal(np.asarray(jax.jit(call)(q)).view(np.uint16), expected.view(np.uint16))
    with pytest.raises(NotImplementedError, match="block_table"):
        jax.grad(lambda q: call(q).astype(jnp.float32).sum())(q)


def test_kvcache_decoding_steps_in_jit(rng):
    """Three jitted decoding steps with donated caches: each appends in place and matches the reference."""
    import cuflash.jax

    batch, capacity, nheads, nheads_kv, headdim = 2, 256, 8, 2, 64
    k_cache, v_cache = (randn(rng, (batch, capacity, nheads_kv, headdim), np.float16) for _ in range(2))
    lengths = np.array([5, 100], np.int32)
    step = jax.jit(lambda q, kc, vc, k, v, n: cuflash.jax.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n,
                                                                              causal=True),
                   donate_argnums=(1, 2))
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    for _ in range(3):
        q = randn(rng, (batch, 1, nheads, headdim), np.float16)
        k, v = (randn(rng, (batch, 1, nheads_kv, headdim), np.float16) for _ in range(2))
        ref, _, k_cache, v_cache = reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                                    causal=True)
        naive, _, _, _ = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths + 1, causal=True,
                                                          lowp_dtype=np.float16)
        out, kc, vc = step(jnp.asarray(q), kc, vc, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
        assert_close_2x(np.asarray(out), ref, naive, ATOL[np.dtype(np.float16)])
        np.testing.assert_array_equal(np.asarray(kc).view(np.int16), k_cache.view(np.int16))
        np.testing.assert_array_equal(np.asarray(vc).view(np.int16), v_cache.view(np.int16))
        lengths = lengths + 1


def test_kvcache_e4m3_cache_in_jit(rng):
    """A jnp.float8_e4m3fn cache with descales in a jitted step: the same output and cache bits as
    cuflash.attention_with_kvcache on the uint8 codes."""
    import cuflash.jax

    step, expected, expected_caches = e4m3_kvcache_step(rng)
    jitted = jax.jit(lambda q, kc, vc, k, v, n, ks, vs: cuflash.jax.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n, k_descale=ks, v_descale=vs), donate_argnums=(1, 2))
    caches = [jnp.asarray(c.view(jnp.float8_e4m3fn)) for c in step["codes"]]
    out, kc, vc = jitted(jnp.asarray(step["q"]), *caches, *(jnp.asarray(x) for x in step["new"]),
                         jnp.asarray(step["lengths"]), *(jnp.asarray(d) for d in step["descales"]))
    np.testing.assert_array_equal(np.asarray(out).view(np.int16), expected.view(np.int16))
    for cache, want in zip((kc, vc), expected_caches):
        np.testing.assert_array_equal(np.asarray(cache).view(np.uint8), want)


def test_shard_map_runs_each_device_on_its_shard(rng):
    """jax.shard_map over the devices present, batch-sharded: forward and gradients against the reference."""
    import cuflash.jax
    from jax.sharding import Mesh, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    host, dout_host = inputs(rng, batch=2 * len(devices), nq=130, nk=130)
    q, k, v = (jnp.asarray(x) for x in host)
    dout = jnp.asarray(dout_host)
    spec = PartitionSpec("d")
    # check_vma=False: the callback's outputs carry no varying-manual-axes annotation for JAX to check.
    sharded = jax.shard_map(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True), mesh=mesh,
                            in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)

    out, grads = jitted_value_and_grads(sharded, q, k, v, dout)
    atol = ATOL[np.dtype(np.float16)]
    ref = reference.attention(*host, causal=True)
    assert_close_2x(np.asarray(out), ref, reference.attention_naive_lowp(*host, causal=True, dtype=np.float16), atol)
    refs = reference.attention_backward(dout_host, *host, causal=True)
    naives = reference.attention_backward_naive_lowp(dout_host, *host, causal=True, dtype=np.float16)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, atol)


def test_dropout_in_jit_follows_its_key(rng):
    """dropout_p with a JAX key inside jit: forward and gradients hold the 2x rule against the
    reference given the mask of the words drawn from the key; they equal eager cuflash given those
    words as seed, bitwise; another key gives another output."""
    import cupy

    import cuflash
    import cuflash.jax

    host, dout = inputs(rng)
    q, k, v = (jnp.asarray(x) for x in host)
    p = 0.2

    def loss(q, k, v, key):
        out = cuflash.jax.attention(q, k, v, causal=True, deterministic=True, dropout_p=p, dropout_key=key)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    key = jax.random.key(5)
    (_, out), grads = step(q, k, v, key)
    words = np.asarray(jax.random.bits(key, (4,), jnp.uint32)).astype(np.uint64)
    seed, offset = int(words[0] | words[1] << 32), int(words[2] | words[3] << 32)
    drop = dict(dropout_mask=reference.dropout_keep_mask(seed, offset, 2, 4, 197, 300, p), dropout_p=p, causal=True)
    atol = ATOL[np.dtype(np.float16)]
    assert_close_2x(np.asarray(out), reference.attention(*host, **drop),
                    reference.attention_naive_lowp(*host, dtype=np.float16, **drop), atol)
    refs = reference.attention_backward(dout, *host, **drop)
    naives = reference.attention_backward_naive_lowp(dout, *host, dtype=np.float16, **drop)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, atol)

    dev = [cupy.asarray(x) for x in host]
    options = dict(causal=True, dropout_p=p, seed=cupy.asarray(words.astype(np.uint32)))
    eager_out, eager_lse = cuflash.attention(*dev, return_lse=True, **options)
    eager_grads = cuflash.attention_backward(cupy.asarray(dout), *dev, eager_out, eager_lse, deterministic=True,
                                             **options)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), eager_out.get().view(np.uint16))
    for g, e in zip(grads, eager_grads):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), e.get().view(np.uint16))
    (_, other), _ = step(q, k, v, jax.random.key(6))
    assert not np.array_equal(np.asarray(other), np.asarray(out))


def test_varlen_dropout_in_jit_equals_eager():
    """attention_varlen with dropout_p and a key inside jit: output and gradients equal eager cuflash
    given the key's words as seed, bitwise."""
    import cupy

    import cuflash
    import cuflash.jax

    rng = np.random.default_rng(21)
    lengths = [17, 0, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    host = [randn(rng, (int(cu[-1]), h, 64), np.float16) for h in (4, 2, 2)]
    dout = randn(rng, host[0].shape, np.float16)
    key = jax.random.key(9)

    def loss(q, k, v):
        out = cuflash.jax.attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 130, 130, causal=True,
                                           deterministic=True, dropout_p=0.3, dropout_key=key)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*map(jnp.asarray, host))
    words = cupy.asarray(np.asarray(jax.random.bits(key, (4,), jnp.uint32)))
    dev = [cupy.asarray(x) for x in host]
    options = dict(causal=True, dropout_p=0.3, seed=words)
    eager_out, eager_lse = cuflash.attention_varlen(*dev, cu, cu, 130, 130, return_lse=True, **options)
    eager_grads = cuflash.attention_varlen_backward(cupy.asarray(dout), *dev, eager_out, eager_lse, cu, cu, 130, 130,
                                                    deterministic=True, **options)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), eager_out.get().view(np.uint16))
    for g, e in zip(grads, eager_grads):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), e.get().view(np.uint16))


def test_ring_attention_under_shard_map_on_the_gpus(rng):
    """cuflash.jax_ring with cuflash's kernels, one rank per GPU present (a ring of one on one GPU),
    zigzag causal: forward and gradients against the float64 reference (2x rule)."""
    import functools

    from jax.sharding import NamedSharding, PartitionSpec

    from cuflash import distributed, jax_ring

    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("sp",), devices=devices)
    host, dout_host = inputs(rng, nq=2 * world * 67, nk=2 * world * 67)
    n = host[0].shape[1]
    order = np.concatenate([distributed.shard_positions(n, r, world) for r in range(world)])
    spec = NamedSharding(mesh, PartitionSpec(None, "sp"))
    q, k, v, dout = (jax.device_put(jnp.asarray(x[:, order]), spec) for x in (*host, dout_host))
    ring = jax.shard_map(functools.partial(jax_ring.ring_attention, axis_name="sp", causal=True), mesh=mesh,
                         in_specs=PartitionSpec(None, "sp"), out_specs=PartitionSpec(None, "sp"), check_vma=False)

    out, grads = jitted_value_and_grads(ring, q, k, v, dout)
    atol = ATOL[np.dtype(np.float16)]
    ref = reference.attention(*host, causal=True)
    naive = reference.attention_naive_lowp(*host, causal=True, dtype=np.float16)
    assert_close_2x(np.asarray(out), ref[:, order], naive[:, order], atol)
    refs = reference.attention_backward(dout_host, *host, causal=True)
    naives = reference.attention_backward_naive_lowp(dout_host, *host, causal=True, dtype=np.float16)
    for g, r, nv in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r[:, order], nv[:, order], atol + ring_rounding(world, r))


def against_jax_nn(host, dout, options):
    """(cuflash's, float32 XLA's, float16 XLA's) jitted value and gradients of dot_product_attention."""
    import cuflash.jax

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)

    got = jitted_value_and_grads(lambda q, k, v: cuflash.jax.dot_product_attention(q, k, v, **options),
                                 *(jnp.asarray(x) for x in host), jnp.asarray(dout))
    ref = jitted_value_and_grads(xla, *(jnp.asarray(x, jnp.float32) for x in host), jnp.asarray(dout))
    naive = jitted_value_and_grads(xla, *(jnp.asarray(x) for x in host), jnp.asarray(dout))
    return got, ref, naive


@pytest.mark.parametrize("nq, nk, causal, window", [
    (64, 64, True, None), (40, 97, True, None), (97, 40, True, None), (70, 70, False, (8, 3)),
    (50, 90, True, 16), (90, 50, False, (60, 0)), (33, 120, False, 5), (120, 33, False, None),
])
def test_dot_product_attention_is_jax_nns(rng, nq, nk, causal, window):
    """cuflash.jax.dot_product_attention against jax.nn.dot_product_attention (its top-left masks): the
    float32 XLA computation is the reference and the float16 one the naive computation of the 2x rule,
    for the output and the gradients, under jax.jit; 3-dim inputs too."""
    import cuflash.jax

    host, dout = inputs(rng, nq=nq, nk=nk)
    options = dict(is_causal=causal, local_window_size=window)
    assert jax_nn_mask(nq, nk, causal, window).any(axis=1).all()  # the cases keep a key in every row

    got, ref, naive = against_jax_nn(host, dout, options)
    atol = ATOL[np.dtype(np.float16)]
    assert_close_2x(np.asarray(got[0], np.float64), np.asarray(ref[0], np.float64), np.asarray(naive[0]), atol)
    for g, r, n in zip(got[1], ref[1], naive[1]):
        assert_close_2x(np.asarray(g, np.float64), np.asarray(r, np.float64), np.asarray(n), atol)
    one = cuflash.jax.dot_product_attention(*(jnp.asarray(x[0]) for x in host), **options)
    batch_of_one = cuflash.jax.dot_product_attention(*(jnp.asarray(x[:1]) for x in host), **options)
    assert np.array_equal(np.asarray(one), np.asarray(batch_of_one[0]))
    # return_residual: the logsumexp (B, T, N) in key's dtype, as jax.nn's (float32 XLA's here)
    out, residual = cuflash.jax.dot_product_attention(*(jnp.asarray(x) for x in host), return_residual=True,
                                                      **options)
    _, want = jax.nn.dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in host), implementation="xla",
                                           return_residual=True, **options)
    assert residual.shape == want.shape and residual.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(residual, np.float32), np.asarray(want), rtol=2e-3, atol=2e-3)
    assert np.array_equal(np.asarray(out), np.asarray(got[0]))


@pytest.mark.parametrize("nq, nk, causal, window, q_lengths, kv_lengths", [
    (64, 64, True, None, [64, 17], [64, 17]), (97, 120, False, None, [1, 97], [120, 33]),
    (90, 50, True, None, [90, 40], [50, 20]), (70, 70, False, (8, 3), [70, 30], [70, 33]),
    (50, 80, True, None, [50, 7], None), (80, 50, False, None, None, [50, 1]),
])
def test_dot_product_attention_with_lengths_is_jax_nns(rng, nq, nk, causal, window, q_lengths, kv_lengths):
    """Padded batches (query_seq_lengths, key_value_seq_lengths) against jax.nn's float32 XLA
    computation with the 2x rule (float16 XLA as the naive one): out and gradients, 0 in the padded
    rows as there; the residual on the rows in use. Every row in use sees a key (else XLA averages)."""
    import cuflash.jax

    host, dout = inputs(rng, nq=nq, nk=nk)
    options = dict(is_causal=causal, local_window_size=window,
                   query_seq_lengths=None if q_lengths is None else jnp.asarray(q_lengths, jnp.int32),
                   key_value_seq_lengths=None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32))

    got, ref, naive = against_jax_nn(host, dout, options)
    atol = ATOL[np.dtype(np.float16)]
    for g, r, n in zip((got[0], *got[1]), (ref[0], *ref[1]), (naive[0], *naive[1])):
        assert_close_2x(np.asarray(g, np.float64), np.asarray(r, np.float64), np.asarray(n), atol)
    used = np.arange(nq)[None, :] < np.asarray(q_lengths if q_lengths is not None else [nq] * 2)[:, None]
    assert np.all(np.asarray(got[0])[~used] == 0)
    _, residual = cuflash.jax.dot_product_attention(*(jnp.asarray(x) for x in host), return_residual=True,
                                                    **options)
    _, want = jax.nn.dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in host), implementation="xla",
                                           return_residual=True, **options)
    assert residual.shape == want.shape and residual.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(residual, np.float32)[used], np.asarray(want)[used], rtol=2e-3,
                               atol=2e-3)


def test_varlen_seqused_in_jit(rng):
    """cuflash.jax.attention_varlen with seqused (device lengths) and bottom-right masks: the
    reference's, 0 in the unused rows of out and the gradients."""
    import cuflash.jax

    spans, used_q, used_k = [40, 0, 130], np.array([17, 0, 100], np.int32), np.array([40, 0, 64], np.int32)
    cu = np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)
    host = [randn(rng, (170, 4, 64), np.float16)] + [randn(rng, (170, 2, 64), np.float16) for _ in range(2)]
    dout = randn(rng, (170, 4, 64), np.float16)
    extra = dict(seqused_q=used_q, seqused_k=used_k)

    def loss(q, k, v):
        out = cuflash.jax.attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 100, 64, causal=True,
                                           **{name: jnp.asarray(x) for name, x in extra.items()})
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jnp.asarray(x) for x in host))
    ref = reference.attention_varlen(*host, cu, cu, causal=True, **extra)
    naive = reference.attention_varlen_naive_lowp(*host, cu, cu, dtype=np.float16, causal=True, **extra)
    assert_close_2x(np.asarray(out), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_varlen_backward(dout, *host, cu, cu, causal=True, **extra)
    naives = reference.attention_varlen_backward_naive_lowp(dout, *host, cu, cu, dtype=np.float16, causal=True,
                                                            **extra)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(np.asarray(g), r, n, ATOL[np.dtype(np.float16)])


@pytest.mark.parametrize("extra, name", [
    (lambda q: dict(bias=jnp.zeros((1, 1, 8, 8), jnp.float16)), "bias"),
    (lambda q: dict(mask=jnp.ones((1, 1, 8, 8), bool)), "mask"),
    (lambda q: dict(local_window_size=(0, 0)), "local_window_size"),
])
def test_dot_product_attention_refuses_what_it_lacks(extra, name):
    """What cuflash does not run raises NotImplementedError by name (a (0, 0) window with more queries
    than keys leaves queries without a key, where jax.nn averages every value)."""
    import cuflash.jax

    q = jnp.zeros((1, 8, 2, 64), jnp.float16)
    k = jnp.zeros((1, 4 if name == "local_window_size" else 8, 2, 64), jnp.float16)
    with pytest.raises(NotImplementedError, match=name):
        cuflash.jax.dot_product_attention(q, k, k, **extra(q))


@pytest.mark.parametrize("window", [(4.5, 2), (1, 2, 3), "4", (-1, 2)])
def test_dot_product_attention_names_a_bad_window(window):
    import cuflash.jax

    q = jnp.zeros((1, 8, 2, 64), jnp.float16)
    with pytest.raises((TypeError, ValueError), match="local_window_size"):
        cuflash.jax.dot_product_attention(q, q, q, local_window_size=window)


def test_return_lse_is_cuflash_attentions_and_takes_no_gradient(rng):
    """cuflash.jax.attention(return_lse=True): the lse of cuflash.attention, and gradients of a loss that
    uses out and lse alike are those of out alone (the lse is stopped, as jax.nn's residual)."""
    import cuflash.jax

    host, dout = inputs(rng, nq=97, nk=130)
    q, k, v = (jnp.asarray(x) for x in host)
    out, lse = jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True, return_lse=True))(q, k, v)
    _, ref_lse = reference.attention(*host, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-3, atol=1e-3)

    def with_lse(q, k, v):
        out, lse = cuflash.jax.attention(q, k, v, causal=True, deterministic=True, return_lse=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)) + jnp.sum(lse)

    def without(q, k, v):
        out = cuflash.jax.attention(q, k, v, causal=True, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32))

    for a, b in zip(jax.jit(jax.grad(with_lse, argnums=(0, 1, 2)))(q, k, v),
                    jax.jit(jax.grad(without, argnums=(0, 1, 2)))(q, k, v)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
