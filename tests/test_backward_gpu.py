"""Correctness of cuflash.attention_backward and cuflash.attention_vjp.

Accuracy rule, as for the forward pass: for each of dq, dk and dv, the
kernel's max abs error against the float64 reference
(cuflash.reference.attention_backward) may be at most twice that of the
naive computation in the input dtype
(cuflash.reference.attention_backward_naive_lowp), plus atol.

atol = eps(dtype) * max|reference gradient| + 1e-5.  The first term is one
unit in the last place of the largest gradient entry, an error any result
stored in float16/bfloat16 may carry.  It is relative because gradient
magnitudes move with the shape (dv grows like sqrt(seqlen_q / seqlen_k), dq
shrinks with softmax_scale), so one absolute atol would be loose for some
cases and meaningless for others.  The 1e-5 floor covers gradients that are
exactly 0 in exact arithmetic (a row that sees a single key has a constant
softmax, so its dq is 0): the naive computation subtracts two equal rounded
numbers there and gets exactly 0, while the kernel's float32
rowsum(dout * out) leaves float32 noise of order 1e-7.

Inputs are built on the host in the low-precision dtype and copied to the
device, so the references see exactly the values the kernel sees.
"""

import functools
import os
import sys

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import dispatch
from cuflash.config import SM90_SMEM_LIMIT, BwdConfig
from cuflash.reference import attention_backward as reference_backward
from cuflash.reference import attention_backward_naive_lowp
from tests.numerics import assert_close_2x, DTYPES, make_inputs, mentions, randn

ABS_FLOOR = 1e-5

# JAX reserves most of the GPU memory when its backend starts unless told not
# to; CuPy and cuflash need some too.  Only effective before jax is imported.
if "jax" not in sys.modules:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = None



def backward(dev, *, causal=False, softmax_scale=None, out=None, **kwargs):
    """Forward with return_lse=True, then attention_backward: (dq, dk, dv)."""
    dout, q, k, v = dev
    out, lse = cuflash.attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, out=out
    )
    return cuflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **kwargs
    )


def atol(ref, dtype):
    return float(ml_dtypes.finfo(dtype).eps) * np.abs(ref).max(initial=0.0) + ABS_FLOOR


def check_grads(grads, host, **kwargs):
    """Hold device (dq, dk, dv) to the 2x rule against host (dout, q, k, v)."""
    refs = reference_backward(*host, **kwargs)
    naives = attention_backward_naive_lowp(*host, dtype=host[1].dtype, **kwargs)
    for name, g, x, ref, naive in zip(("dq", "dk", "dv"), grads, host[1:], refs, naives):
        assert isinstance(g, cupy.ndarray), name
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        try:
            assert_close_2x(g.get(), ref, naive, atol(ref, x.dtype))
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def check(host, dev, out=None, **kwargs):
    check_grads(backward(dev, out=out, **kwargs), host, **kwargs)


def bits(x):
    """Host copy of a float16/bfloat16 device array as raw 16-bit integers."""
    return x.get().view(np.uint16)


# --- Accuracy ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [32, 64, 72, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims(rng, dtype, headdim, causal):
    host, dev = make_inputs(rng, dtype, 2, 97, 97, 2, 2, headdim)
    check(host, dev, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nq,nk",
    [(1, 1), (17, 17), (97, 97), (257, 257), (1025, 1025),
     (17, 257), (257, 17), (1, 97), (1025, 97)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(rng, dtype, nq, nk, causal):
    host, dev = make_inputs(rng, dtype, 1, nq, nk, 2, 2, 64)
    check(host, dev, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_kv", [2, 1])
@pytest.mark.parametrize("nq,nk", [(97, 129), (129, 97)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(rng, dtype, nheads_kv, nq, nk, causal):
    host, dev = make_inputs(rng, dtype, 2, nq, nk, 4, nheads_kv, 64)
    check(host, dev, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [pytest.param("hopper", marks=pytest.mark.hopper), "sm80"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128, 88, 176, 192, 256])
@pytest.mark.parametrize("nq,nk", [(257, 300), (128, 256), (300, 129)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dkdv_kernels(monkeypatch, rng, kernel, dtype, headdim, nq, nk, causal, deterministic):
    # Both dK/dV kernels on the same GPU: the Hopper ones (head dims 64 and
    # 128, 88 zero-padded to 128, fed by tensor maps, fused atomic dQ; 192's
    # and 256's with the dQ kernel in either mode, 176 zero-padded to 192) and
    # the sm_80 one. GQA, ragged and
    # block-aligned lengths, Nq < Nk and Nq > Nk.
    if kernel == "sm80":
        monkeypatch.setattr(dispatch, "HEURISTIC_BWD_SM90", {})
    host, dev = make_inputs(rng, dtype, 2, nq, nk, 4, 2, headdim)
    cc = cupy.cuda.Device().compute_capability
    chosen = dispatch.bwd_tiles(headdim, SM90_SMEM_LIMIT, int(cc), deterministic)
    assert chosen.hopper == (kernel == "hopper")
    with dispatch.heuristic_only():
        grads = backward(dev, causal=causal, deterministic=deterministic)
    check_grads(grads, host, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax_scale", [0.3, 2.0])
def test_softmax_scale(rng, dtype, softmax_scale):
    host, dev = make_inputs(rng, dtype, 2, 97, 129, 2, 2, 64)
    check(host, dev, causal=True, softmax_scale=softmax_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhnd", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs(rng, dtype, layout, causal):
    batch, nq, nk, nheads, headdim = 2, 65, 97, 2, 64
    if layout == "bhnd":
        # dout, q, k, v and the forward's out stored as (batch, nheads, seqlen, headdim).
        bases = [
            randn(rng, (batch, nheads, n, headdim), dtype) for n in (nq, nq, nk, nk)
        ]
        host = tuple(x.transpose(0, 2, 1, 3) for x in bases)
        dev = tuple(cupy.asarray(x).transpose(0, 2, 1, 3) for x in bases)
        out = cupy.empty((batch, nheads, nq, headdim), dtype).transpose(0, 2, 1, 3)
    else:
        # dout, q: halves of the heads of wider tensors (non-zero offset for q);
        # k, v: interleaved in one (batch, seqlen, 2, nheads, headdim) tensor.
        doq_base = randn(rng, (batch, nq, 2 * nheads, headdim), dtype)
        kv_base = randn(rng, (batch, nk, 2, nheads, headdim), dtype)
        doq_dev, kv_dev = cupy.asarray(doq_base), cupy.asarray(kv_base)
        host = (doq_base[:, :, :nheads], doq_base[:, :, nheads:], kv_base[:, :, 0], kv_base[:, :, 1])
        dev = (doq_dev[:, :, :nheads], doq_dev[:, :, nheads:], kv_dev[:, :, 0], kv_dev[:, :, 1])
        out = None
    check(host, dev, causal=causal, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["reversed_heads", "broadcast_heads"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dout_the_tensor_maps_cannot_take(rng, layout, deterministic):
    """A dout the Hopper kernels copy (negative or zero head stride): the preprocess must read the
    same copy with the copy's strides."""
    host, dev = make_inputs(rng, np.float16, 2, 193, 130, 4, 2, 64)
    if layout == "reversed_heads":
        dout_host, dout_dev = host[0][:, :, ::-1], dev[0][:, :, ::-1]
    else:
        dout_host = np.broadcast_to(host[0][:, :, :1], host[0].shape)
        dout_dev = cupy.broadcast_to(dev[0][:, :, :1], dev[0].shape)
    check_grads(backward((dout_dev, *dev[1:]), deterministic=deterministic), (dout_host, *host[1:]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_layout", ["contiguous", "every_other_head"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_grad_arguments(rng, dtype, out_layout, deterministic):
    batch, nq, nk, nheads, nheads_kv, headdim = 2, 97, 129, 4, 2, 64
    host, dev = make_inputs(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim)
    # Poison whole buffers so unwritten elements show up as NaN.
    wide = 1 if out_layout == "contiguous" else 2
    storage = [
        cupy.asarray(np.full((batch, n, wide * h, headdim), np.nan, dtype))
        for n, h in ((nq, nheads), (nk, nheads_kv), (nk, nheads_kv))
    ]
    given = [x[:, :, ::wide] for x in storage]

    grads = backward(
        dev, causal=True, deterministic=deterministic, dq=given[0], dk=given[1], dv=given[2]
    )
    assert all(g is x for g, x in zip(grads, given))
    check_grads(tuple(x[:, :, ::wide] for x in storage), host, causal=True)
    if out_layout == "every_other_head":
        for x in storage:
            assert np.isnan(x[:, :, 1::2].get().astype(np.float32)).all()  # untouched


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["dq", "dk", "dv"])
def test_some_grad_arguments(rng, arg):
    host, dev = make_inputs(rng, np.float16, 2, 97, 97, 4, 1, 64)
    shapes = {"dq": host[1].shape, "dk": host[2].shape, "dv": host[3].shape}
    given = cupy.full(shapes[arg], np.nan, np.float16)
    grads = backward(dev, causal=True, **{arg: given})
    assert grads[["dq", "dk", "dv"].index(arg)] is given
    check_grads(grads, host, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nk", [(257, 17), (64, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_fully_masked_rows(rng, dtype, nq, nk, deterministic):
    # Causal with nq > nk: the first nq - nk query rows see no key.
    host, _ = make_inputs(rng, dtype, 2, nq, nk, 4, 2, 64)
    masked = nq - nk
    # A large dout on those rows must not leak into dk or dv.
    host[0][:, :masked] = 100
    dev = tuple(cupy.asarray(x) for x in host)
    grads = backward(dev, causal=True, deterministic=deterministic)
    for g in grads:
        assert not np.isnan(g.get().astype(np.float32)).any()
    assert np.all(grads[0][:, :masked].get().astype(np.float32) == 0)
    check_grads(grads, host, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("headdim", [64, 192, 256])
def test_deterministic(rng, dtype, causal, deterministic, headdim):
    # Many query heads per kv head and several blocks per sequence: the most
    # contributions to each dk/dv and dq element from different thread blocks.
    host, dev = make_inputs(rng, dtype, 2, 513, 513, 4, 1, headdim)
    dout, q, k, v = dev
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    first = cuflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, deterministic=deterministic
    )
    check_grads(first, host, causal=causal)
    if deterministic:
        second = cuflash.attention_backward(
            dout, q, k, v, out, lse, causal=causal, deterministic=True
        )
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim, block_m", [(64, 128), (128, 64), (72, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_query_chunks_are_bitwise_exact(monkeypatch, rng, dtype, headdim, block_m, causal):
    # Scores held for a chunk of queries at a time change no product and no
    # order of accumulation: dk and dv (and the deterministic dq) keep their bits.
    host, dev = make_inputs(rng, dtype, 1, 300, 333, 4, 2, headdim)
    dout, q, k, v = dev
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    kd = 128 if headdim > 64 else 64
    monkeypatch.setattr(dispatch, "HEURISTIC_BWD_SM90", {})  # the sm_80 dK/dV kernel on Hopper too
    grads = {}
    for chunk in (0, 16, 32, 64):  # 0: the whole block
        monkeypatch.setitem(dispatch.HEURISTIC_BWD, kd, BwdConfig(kd, block_m, 8, 4, 64, dkdv_chunk_m=chunk))
        with dispatch.heuristic_only():
            grads[chunk] = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    check_grads(grads[16], host, causal=causal)
    for chunk, chunk_grads in grads.items():
        for name, a, b in zip(("dq", "dk", "dv"), chunk_grads, grads[0]):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name}, chunk {chunk}")


@pytest.mark.gpu
def test_non_default_stream(rng):
    _, dev = make_inputs(rng, np.float16, 2, 257, 257, 4, 2, 64)
    want = [g.get() for g in backward(dev, causal=True, deterministic=True)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Copies queued on the stream: the kernels must be ordered after them.
        grads = backward(tuple(x.copy() for x in dev), causal=True, deterministic=True)
        got = [g.get() for g in grads]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.gpu
def test_persistent_backward_calls_of_other_shapes(rng):
    """The persistent Hopper dK/dV kernel's CTAs take tiles from a ticket that its last holder resets:
    calls of other shapes (more tiles than SMs, GQA, causal or not) one after another on one stream
    stay exact."""
    for batch, nq, nk, nheads, nheads_kv, headdim, causal in (
            (2, 33, 2048, 4, 2, 64, False), (3, 17, 2048, 8, 8, 128, True), (2, 33, 2048, 4, 2, 64, False),
            (1, 97, 1000, 2, 1, 128, True)):
        host, dev = make_inputs(rng, np.float16, batch, nq, nk, nheads, nheads_kv, headdim)
        check(host, dev, causal=causal)


# --- attention_vjp ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softmax_scale", [None, 0.5])
def test_vjp(rng, dtype, causal, softmax_scale):
    host, dev = make_inputs(rng, dtype, 2, 97, 129, 4, 2, 64)
    dout, q, k, v = dev
    kwargs = dict(causal=causal, softmax_scale=softmax_scale)

    out, vjp = cuflash.attention_vjp(q, k, v, **kwargs)
    want_out, lse = cuflash.attention(q, k, v, return_lse=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(bits(out), bits(want_out))

    grads = vjp(dout)
    want = cuflash.attention_backward(dout, q, k, v, want_out, lse, **kwargs)
    eps = float(ml_dtypes.finfo(dtype).eps)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        # The same kernels; only the order of float32 atomic additions may
        # differ between calls, which moves a result by at most about one ulp.
        g, w = g.get().astype(np.float64), w.get().astype(np.float64)
        np.testing.assert_allclose(g, w, rtol=0, atol=eps * np.abs(w).max(), err_msg=name)
    check_grads(grads, host, **kwargs)


# --- JAX through DLPack -----------------------------------------------------
#
# cuflash as a differentiable JAX function, zero-copy both ways on the same
# GPU.  It runs eagerly: cuflash needs concrete arrays, so not under jax.jit.
# Start JAX with XLA_PYTHON_CLIENT_PREALLOCATE=false so that it leaves GPU
# memory for CuPy.  The residuals kept for the backward pass must be JAX
# arrays, so the forward keeps q, k, v, out and lse rather than a closure.

if jax is not None:

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def flash_attention_jax(q, k, v, causal):
        return _flash_attention_fwd(q, k, v, causal)[0]

    def _flash_attention_fwd(q, k, v, causal):
        out, lse = cuflash.attention(
            cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(v),
            causal=causal, return_lse=True,
        )
        out, lse = jax.dlpack.from_dlpack(out), jax.dlpack.from_dlpack(lse)
        return out, (q, k, v, out, lse)

    def _flash_attention_bwd(causal, residuals, dout):
        q, k, v, out, lse = (cupy.from_dlpack(x) for x in residuals)
        grads = cuflash.attention_backward(
            cupy.from_dlpack(dout), q, k, v, out, lse, causal=causal
        )
        return tuple(jax.dlpack.from_dlpack(g) for g in grads)

    flash_attention_jax.defvjp(_flash_attention_fwd, _flash_attention_bwd)


def require_jax_gpu():
    if jax is None:
        pytest.skip("jax is not installed")
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false":
        pytest.skip("jax was imported before XLA_PYTHON_CLIENT_PREALLOCATE=false was set")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax has no GPU backend")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_jax_custom_vjp(rng, causal):
    require_jax_gpu()
    host, _ = make_inputs(rng, np.float16, 2, 97, 129, 4, 2, 64)
    g, q, k, v = (jax.device_put(x, jax.devices("gpu")[0]) for x in host)

    def loss(q, k, v):
        out = flash_attention_jax(q, k, v, causal)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    # The cotangent reaching the custom rule is g rounded to float16, which
    # is g itself: host[0] is the reference's dout.
    check_grads(tuple(cupy.from_dlpack(x) for x in grads), host, causal=causal)


# --- Argument validation ----------------------------------------------------

B, NQ, NK, H, HKV, D = 2, 8, 16, 4, 2, 64


def np_args(dtype=np.float16):
    """Host (dout, q, k, v, out, lse) of consistent shapes."""
    return (
        np.zeros((B, NQ, H, D), dtype),
        np.zeros((B, NQ, H, D), dtype),
        np.zeros((B, NK, HKV, D), dtype),
        np.zeros((B, NK, HKV, D), dtype),
        np.zeros((B, NQ, H, D), dtype),
        np.zeros((B, H, NQ), np.float32),
    )


def cp_args():
    """Device (dout, q, k, v, out, lse) from a real forward pass."""
    dout, q, k, v = (cupy.asarray(x) for x in np_args()[:4])
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    return dout, q, k, v, out, lse


def test_backward_numpy_inputs_rejected():
    with pytest.raises(TypeError, match=mentions("dout")):
        cuflash.attention_backward(*np_args())


def test_vjp_numpy_inputs_rejected():
    with pytest.raises(TypeError, match=mentions("q")):
        cuflash.attention_vjp(*np_args()[1:4])


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["dout", "q", "k", "v", "out", "lse"])
def test_backward_one_numpy_input_rejected(arg):
    names = ["dout", "q", "k", "v", "out", "lse"]
    args = dict(zip(names, cp_args()))
    args[arg] = args[arg].get()
    with pytest.raises(TypeError, match=mentions(arg)):
        cuflash.attention_backward(*(args[n] for n in names))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(B, NQ, H), (B, H, NQ + 1), (B, H, NQ, 1), (B + 1, H, NQ)])
def test_lse_wrong_shape(shape):
    dout, q, k, v, out, _ = cp_args()
    with pytest.raises(ValueError, match=mentions("lse")):
        cuflash.attention_backward(dout, q, k, v, out, cupy.zeros(shape, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_lse_wrong_dtype(dtype):
    dout, q, k, v, out, lse = cp_args()
    with pytest.raises(TypeError, match=mentions("lse")):
        cuflash.attention_backward(dout, q, k, v, out, lse.astype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["dout", "out"])
@pytest.mark.parametrize("shape", [(B, NQ + 1, H, D), (B, NQ, H, D + 8), (B, NQ, H)])
def test_dout_or_out_wrong_shape(arg, shape):
    args = dict(zip(["dout", "q", "k", "v", "out", "lse"], cp_args()))
    args[arg] = cupy.zeros(shape, np.float16)
    with pytest.raises(ValueError, match=mentions(arg)):
        cuflash.attention_backward(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["dout", "out"])
def test_dout_or_out_wrong_dtype(arg):
    args = dict(zip(["dout", "q", "k", "v", "out", "lse"], cp_args()))
    args[arg] = args[arg].astype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=mentions(arg)):
        cuflash.attention_backward(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["dq", "dk", "dv"])
def test_grad_argument_wrong_shape_or_dtype(arg):
    dout, q, k, v, out, lse = cp_args()
    like = {"dq": q, "dk": k, "dv": v}[arg]
    bad_shape = cupy.zeros(like.shape[:-1] + (like.shape[-1] + 8,), like.dtype)
    with pytest.raises(ValueError, match=mentions(arg)):
        cuflash.attention_backward(dout, q, k, v, out, lse, **{arg: bad_shape})
    bad_dtype = cupy.zeros(like.shape, ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=mentions(arg)):
        cuflash.attention_backward(dout, q, k, v, out, lse, **{arg: bad_dtype})


@pytest.mark.gpu
def test_vjp_dout_validated():
    _, q, k, v, _, _ = cp_args()
    _, vjp = cuflash.attention_vjp(q, k, v)
    with pytest.raises(ValueError, match=mentions("dout")):
        vjp(cupy.zeros((B, NQ + 1, H, D), np.float16))
    with pytest.raises(TypeError, match=mentions("dout")):
        vjp(np.zeros((B, NQ, H, D), np.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_misaligned_contiguous_inputs(rng, causal):
    """Contiguous inputs whose base pointer is 2 bytes off a 16-byte boundary
    are copied to fresh (aligned) memory by both passes."""
    host, dev = make_inputs(rng, np.float16, 2, 97, 130, 4, 2, 64)

    def shifted(x):
        flat = cupy.zeros(x.size + 1, x.dtype)
        y = flat[1:].reshape(x.shape)
        y[...] = x
        assert y.data.ptr % 16 == 2 and y.flags.c_contiguous
        return y

    check(host, tuple(shifted(x) for x in dev), causal=causal)
