"""Sliding windows, softcap and ALiBi in cuflash.attention, attention_backward
and attention_vjp, against cuflash.reference with the 2x rule.

Both kernel families run every accuracy case: on a Hopper GPU the Hopper
kernels by default ("hopper"), and the sm_80 kernels with the Hopper tables
emptied ("sm80"). Both ignore the tuning cache.

Inputs are built on the host in the low-precision dtype and copied to the
device, so the references see exactly the values the kernels see.
"""

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference
from tests.numerics import check_lse, assert_close_2x, ATOL, DTYPES, make_inputs, make_qkv, mentions, randn

pytestmark = pytest.mark.gpu

# Option sets by name. "alibi" stands for random slopes of shape (nheads,)
# ("h") or (batch, nheads) ("bh"), drawn per test by `materialise`.
OPTIONS = {
    "window": dict(window_size=(32, 16)),
    "window_left": dict(window_size=(48, -1)),
    "window_right": dict(window_size=(-1, 24)),
    "window_causal": dict(window_size=(40, -1), causal=True),
    "softcap": dict(softcap=2.0),
    "alibi_h": dict(alibi="h"),
    "alibi_bh_causal": dict(alibi="bh", causal=True),
    "softcap_alibi": dict(softcap=5.0, alibi="bh"),
    "all": dict(window_size=(64, -1), causal=True, softcap=3.0, alibi="h"),
}
SOME = ["window_causal", "softcap_alibi", "all"]

def materialise(name, rng, batch, nheads):
    """(host kwargs, device kwargs) of the named options, with random ALiBi slopes where asked."""
    options = dict(OPTIONS[name])
    shape = {"h": (nheads,), "bh": (batch, nheads)}.get(options.pop("alibi", None))
    if shape is None:
        return options, options
    slopes = rng.uniform(0.01, 0.3, shape).astype(np.float32)
    return {**options, "alibi_slopes": slopes}, {**options, "alibi_slopes": cupy.asarray(slopes)}



def bits(x):
    """Host copy of a 16-bit device array as raw 16-bit integers."""
    return x.get().view(np.uint16)


# --- Forward ----------------------------------------------------------------



def check_forward(host, dev, options, **outputs):
    """Run the forward on dev inputs with (host, device) options; hold out and lse to the reference."""
    host_kw, dev_kw = options
    out, lse = cuflash.attention(*dev, return_lse=True, **dev_kw, **outputs)
    assert out.shape == dev[0].shape and out.dtype == dev[0].dtype
    ref, ref_lse = reference.attention(*host, return_lse=True, **host_kw)
    naive = reference.attention_naive_lowp(*host, dtype=host[0].dtype, **host_kw)
    assert_close_2x(out.get(), ref, naive, ATOL[out.dtype])
    check_lse(lse, ref_lse)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("nq,nk,headdim", [(257, 1025, 128), (1025, 257, 64)])
def test_forward_options(kernel, rng, dtype, name, nq, nk, headdim):
    # GQA, Nq < Nk and Nq > Nk; with Nq > Nk the windows with a right bound
    # leave the first rows without keys.
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 4, 2, headdim)
    check_forward(host, dev, materialise(name, rng, 2, 4))


@pytest.mark.parametrize("name", ["window", "all"])
@pytest.mark.parametrize(
    "nq,nk,dtype",
    [(1, 1, np.float16), (17, 17, ml_dtypes.bfloat16), (97, 97, np.float16), (1, 1025, ml_dtypes.bfloat16),
     (17, 257, np.float16), (257, 17, ml_dtypes.bfloat16), (97, 1, np.float16), (1025, 1025, ml_dtypes.bfloat16)],
)
def test_forward_seqlens(kernel, rng, name, nq, nk, dtype):
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 2, 2, 64)
    check_forward(host, dev, materialise(name, rng, 2, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("name", ["window", "softcap_alibi"])
def test_forward_headdims(kernel, rng, dtype, headdim, name):
    host, dev = make_qkv(rng, dtype, 2, 197, 300, 2, 2, headdim)
    check_forward(host, dev, materialise(name, rng, 2, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_saturated_softcap(kernel, rng, dtype, softcap, causal):
    # Scores far past the softcap, each row's of one sign: the capped scores sit near +softcap or
    # -softcap, every row's exponentials near one another.
    batch, nq, nk, nheads, headdim = 2, 193, 301, 2, 128
    direction = rng.standard_normal(headdim)
    direction /= np.linalg.norm(direction)
    sign = np.where(rng.random((batch, nq, nheads, 1)) < 0.5, -1.0, 1.0)
    q = (80 * sign * direction + rng.standard_normal((batch, nq, nheads, headdim))).astype(dtype)
    k = (40 * direction + rng.standard_normal((batch, nk, nheads, headdim))).astype(dtype)
    v = randn(rng, (batch, nk, nheads, headdim), dtype)
    host = (q, k, v)
    options = dict(softcap=softcap, causal=causal)
    check_forward(host, tuple(cupy.asarray(x) for x in host), (options, options))


@pytest.mark.parametrize("nheads_kv", [2, 1])
@pytest.mark.parametrize("nq,nk", [(97, 300), (300, 97)])
@pytest.mark.parametrize("name", ["window", "window_causal"])
def test_forward_window_gqa(kernel, rng, nheads_kv, nq, nk, name):
    host, dev = make_qkv(rng, ml_dtypes.bfloat16, 2, nq, nk, 6, nheads_kv, 64)
    check_forward(host, dev, materialise(name, rng, 2, 6))


def strided_qkv(rng, dtype, layout, batch, nq, nk, nheads, headdim):
    """Host and device (q, k, v) views: (batch, nheads, seqlen, headdim) storage transposed, or q the
    second half of the heads of a wider array (non-zero offset) and k, v interleaved in one array."""
    if layout == "bhnd":
        bases = [randn(rng, (batch, nheads, n, headdim), dtype) for n in (nq, nk, nk)]
        host = tuple(x.transpose(0, 2, 1, 3) for x in bases)
        return host, tuple(cupy.asarray(x).transpose(0, 2, 1, 3) for x in bases)
    q_base = randn(rng, (batch, nq, 2 * nheads, headdim), dtype)
    kv_base = randn(rng, (batch, nk, 2, nheads, headdim), dtype)
    q_dev, kv_dev = cupy.asarray(q_base), cupy.asarray(kv_base)
    host = (q_base[:, :, nheads:], kv_base[:, :, 0], kv_base[:, :, 1])
    return host, (q_dev[:, :, nheads:], kv_dev[:, :, 0], kv_dev[:, :, 1])


@pytest.mark.parametrize("layout", ["bhnd", "packed"])
@pytest.mark.parametrize("name", ["window_causal", "all"])
def test_forward_strided_views(kernel, rng, layout, name):
    host, dev = strided_qkv(rng, np.float16, layout, 2, 129, 200, 2, 128)
    assert not dev[0].flags.c_contiguous
    check_forward(host, dev, materialise(name, rng, 2, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["window", "all"])
def test_forward_poisoned_outputs(kernel, rng, dtype, name):
    # Nq > Nk: with these windows the first rows see no key; they too must be written.
    batch, nq, nk, nheads = 2, 300, 97, 4
    host, dev = make_qkv(rng, dtype, batch, nq, nk, nheads, 2, 64)
    out = cupy.asarray(np.full((batch, nq, nheads, 64), np.nan, dtype))
    lse = cupy.full((batch, nheads, nq), np.nan, cupy.float32)
    got, got_lse = check_forward(host, dev, materialise(name, rng, batch, nheads), out=out, lse=lse)
    assert got is out and got_lse is lse
    assert not np.isnan(out.get().astype(np.float32)).any()
    assert not np.isnan(lse.get()).any()
    assert np.isneginf(lse.get()).any()  # the case has rows without keys


@pytest.mark.parametrize("nq,nk", [(97, 97), (300, 129), (129, 300)])
def test_wide_window_and_causal_window_are_exact(kernel, rng, nq, nk):
    # A window wider than the sequences changes nothing; window (-1, 0) is causal,
    # and causal=True overrides a window's right bound.
    host, dev = make_qkv(rng, np.float16, 2, nq, nk, 4, 2, 64)
    wide = nq + nk
    pairs = [(dict(), dict(window_size=(wide, wide))),
             (dict(causal=True), dict(window_size=(-1, 0))),
             (dict(causal=True), dict(causal=True, window_size=(-1, 5))),
             (dict(causal=True), dict(causal=True, window_size=(wide, -1)))]
    for plain, windowed in pairs:
        want, want_lse = cuflash.attention(*dev, return_lse=True, **plain)
        got, got_lse = cuflash.attention(*dev, return_lse=True, **windowed)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=str(windowed))
        np.testing.assert_array_equal(got_lse.get(), want_lse.get(), err_msg=str(windowed))


def test_plans_follow_options(kernel, rng):
    """Calls of one shape with other options, and other slope values, each match their reference:
    a launch plan never carries one call's options or slopes into another."""
    host, dev = make_qkv(rng, np.float16, 2, 97, 130, 4, 2, 64)
    cases = [({}, {}), materialise("window", rng, 2, 4), materialise("window_right", rng, 2, 4),
             ({"softcap": 1.0}, {"softcap": 1.0}), materialise("softcap", rng, 2, 4),
             materialise("alibi_h", rng, 2, 4), materialise("alibi_h", rng, 2, 4)]
    for _ in range(2):
        for options in cases:
            check_forward(host, dev, options)
    host_kw, dev_kw = cases[-1]
    new_slopes = rng.uniform(0.01, 0.3, 4).astype(np.float32)
    dev_kw["alibi_slopes"][...] = cupy.asarray(new_slopes)  # in place: same pointer, new values
    check_forward(host, dev, ({"alibi_slopes": new_slopes}, dev_kw))


# --- fp8 forward (Hopper) ---------------------------------------------------


def fp8_inputs(rng, batch, nq, nk, nheads, nheads_kv, headdim):
    """Device e4m3 bits of q, k, v, device descales per (batch, kv head), and the dequantised float64 values."""
    qf = rng.standard_normal((batch, nq, nheads_kv, nheads // nheads_kv * headdim))
    kf, vf = (rng.standard_normal((batch, nk, nheads_kv, headdim)) for _ in range(2))
    quantised = [reference.fp8_quantize(x) for x in (qf, kf, vf)]
    values = [reference.fp8_dequantize(b, s) for b, s in quantised]
    values[0] = values[0].reshape(batch, nq, nheads, headdim)
    bits_ = [cupy.asarray(b) for b, _ in quantised]
    bits_[0] = bits_[0].reshape(batch, nq, nheads, headdim)
    descales = {f"{n}_descale": cupy.asarray(s) for n, (_, s) in zip("qkv", quantised)}
    return bits_, descales, values


@pytest.mark.hopper
@pytest.mark.parametrize("options", [dict(window_size=(64, 32)), dict(window_size=(128, -1), causal=True),
                                     dict(softcap=2.0), dict(softcap=4.0, window_size=(96, 0))],
                         ids=["window", "window_causal", "softcap", "softcap_window"])
@pytest.mark.parametrize("nq,nk", [(257, 1025), (1025, 97), (1, 97)])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_forward_options(rng, options, nq, nk, headdim):
    bits_, descales, values = fp8_inputs(rng, 2, nq, nk, 4, 2, headdim)
    out = cupy.full(bits_[0].shape, np.nan, ml_dtypes.bfloat16)
    got, lse = cuflash.attention(*bits_, out=out, return_lse=True, **descales, **options)
    assert got is out
    ref, ref_lse = reference.attention(*values, return_lse=True, **options)
    naive = reference.attention_naive_fp8(*values, **options)
    assert_close_2x(got.get().astype(np.float64), ref, naive, 1e-2)
    got_lse = lse.get()
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(got_lse[~finite]))
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)


# --- Backward ---------------------------------------------------------------
#
# atol as in test_backward_gpu.py: one ulp of the largest reference gradient
# plus a floor for gradients that are exactly 0 in exact arithmetic.



def backward(dev, dev_kw, deterministic=False, **grads):
    """Forward with return_lse=True, then attention_backward: (dq, dk, dv)."""
    dout, q, k, v = dev
    out, lse = cuflash.attention(q, k, v, return_lse=True, **dev_kw)
    return cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **dev_kw, **grads)


def check_grads(grads, host, host_kw):
    """Hold device (dq, dk, dv) to the 2x rule against host (dout, q, k, v)."""
    refs = reference.attention_backward(*host, **host_kw)
    naives = reference.attention_backward_naive_lowp(*host, dtype=host[1].dtype, **host_kw)
    for name, g, x, ref, naive in zip(("dq", "dk", "dv"), grads, host[1:], refs, naives):
        assert isinstance(g, cupy.ndarray), name
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        atol = float(ml_dtypes.finfo(x.dtype).eps) * np.abs(ref).max(initial=0.0) + 1e-5
        try:
            assert_close_2x(g.get(), ref, naive, atol)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def check_backward(host, dev, options, **kwargs):
    host_kw, dev_kw = options
    grads = backward(dev, dev_kw, **kwargs)
    check_grads(grads, host, host_kw)
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
def test_backward_options(kernel, rng, dtype, name):
    # GQA and Nq > Nk (rows without keys under windows with a right bound).
    host, dev = make_inputs(rng, dtype, 2, 300, 129, 4, 2, 64)
    check_backward(host, dev, materialise(name, rng, 2, 4))


@pytest.mark.parametrize("name", SOME)
@pytest.mark.parametrize("nq,nk", [(129, 300), (97, 97)])
def test_backward_options_headdim_128(kernel, rng, name, nq, nk):
    host, dev = make_inputs(rng, ml_dtypes.bfloat16, 2, nq, nk, 4, 1, 128)
    check_backward(host, dev, materialise(name, rng, 2, 4))


@pytest.mark.parametrize(
    "nq,nk,dtype",
    [(1, 1, np.float16), (17, 257, ml_dtypes.bfloat16), (257, 17, np.float16), (1, 97, ml_dtypes.bfloat16),
     (1025, 1025, np.float16)],
)
def test_backward_seqlens(kernel, rng, nq, nk, dtype):
    host, dev = make_inputs(rng, dtype, 1, nq, nk, 2, 2, 64)
    check_backward(host, dev, materialise("all", rng, 1, 2))


@pytest.mark.parametrize("headdim", [96, 192, 256])
@pytest.mark.parametrize("name", ["window", "softcap_alibi"])
def test_backward_headdims(kernel, rng, headdim, name):
    host, dev = make_inputs(rng, np.float16, 2, 197, 200, 2, 2, headdim)
    check_backward(host, dev, materialise(name, rng, 2, 2))


@pytest.mark.parametrize("layout", ["bhnd", "packed"])
def test_backward_strided_views(kernel, rng, layout):
    (q, k, v), (dq, dk, dv) = strided_qkv(rng, np.float16, layout, 2, 129, 200, 2, 64)
    dout = randn(rng, q.shape, np.float16)
    check_backward((dout, q, k, v), (cupy.asarray(dout), dq, dk, dv), materialise("all", rng, 2, 2))


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_poisoned_grads(kernel, rng, deterministic):
    # Rows without keys (Nq > Nk, causal) get dq = 0, written like every other element.
    batch, nq, nk, nheads, nheads_kv = 2, 300, 97, 4, 2
    host, dev = make_inputs(rng, np.float16, batch, nq, nk, nheads, nheads_kv, 64)
    given = {name: cupy.full(x.shape, np.nan, np.float16) for name, x in zip(("dq", "dk", "dv"), host[1:])}
    grads = check_backward(host, dev, materialise("all", rng, batch, nheads), deterministic=deterministic, **given)
    assert all(g is x for g, x in zip(grads, given.values()))
    for g in grads:
        assert not np.isnan(g.get().astype(np.float32)).any()
    assert np.all(grads[0][:, : nq - nk].get().astype(np.float32) == 0)


@pytest.mark.parametrize("name", ["window", "all"])
def test_backward_deterministic_is_bitwise(kernel, rng, name):
    # Many query heads per kv head and several blocks per sequence: many contributions to each gradient.
    host, dev = make_inputs(rng, np.float16, 2, 513, 513, 4, 1, 64)
    options = materialise(name, rng, 2, 4)
    first = check_backward(host, dev, options, deterministic=True)
    second = backward(dev, options[1], deterministic=True)
    for grad, a, b in zip(("dq", "dk", "dv"), first, second):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=grad)


@pytest.mark.parametrize("nq,nk", [(97, 97), (300, 129)])
def test_backward_wide_window_and_causal_window_are_exact(kernel, rng, nq, nk):
    _, dev = make_inputs(rng, np.float16, 2, nq, nk, 4, 2, 64)
    wide = nq + nk
    for plain, windowed in [(dict(), dict(window_size=(wide, wide))), (dict(causal=True), dict(window_size=(-1, 0)))]:
        want = backward(dev, plain, deterministic=True)
        got = backward(dev, windowed, deterministic=True)
        for grad, a, b in zip(("dq", "dk", "dv"), got, want):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{grad} {windowed}")


def test_backward_plans_follow_options(kernel, rng):
    host, dev = make_inputs(rng, np.float16, 2, 97, 130, 4, 2, 64)
    cases = [({}, {}), materialise("window", rng, 2, 4), materialise("softcap", rng, 2, 4),
             materialise("alibi_h", rng, 2, 4), materialise("alibi_h", rng, 2, 4)]
    for _ in range(2):
        for options in cases:
            check_backward(host, dev, options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["window_causal", "all"])
def test_vjp_options(rng, dtype, name):
    host, dev = make_inputs(rng, dtype, 2, 97, 129, 4, 2, 64)
    host_kw, dev_kw = materialise(name, rng, 2, 4)
    dout, q, k, v = dev
    out, vjp = cuflash.attention_vjp(q, k, v, **dev_kw)
    want_out, lse = cuflash.attention(q, k, v, return_lse=True, **dev_kw)
    np.testing.assert_array_equal(bits(out), bits(want_out))
    grads = vjp(dout, deterministic=True)
    want = cuflash.attention_backward(dout, q, k, v, want_out, lse, deterministic=True, **dev_kw)
    for grad, a, b in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=grad)
    check_grads(grads, host, host_kw)


# --- Argument validation ----------------------------------------------------

B, NQ, NK, H, HKV, D = 2, 8, 16, 4, 2, 64

BAD = {
    "window_below_minus_one": ("window_size", lambda: (-2, 0), ValueError),
    "window_not_a_pair": ("window_size", lambda: (4,), TypeError),
    "window_floats": ("window_size", lambda: (4.0, 0.0), TypeError),
    "softcap_negative": ("softcap", lambda: -1.0, ValueError),
    "softcap_nan": ("softcap", lambda: float("nan"), ValueError),
    "slopes_float16": ("alibi_slopes", lambda: cupy.ones(H, cupy.float16), TypeError),
    "slopes_float64": ("alibi_slopes", lambda: cupy.ones((B, H), cupy.float64), TypeError),
    "slopes_shape": ("alibi_slopes", lambda: cupy.ones(H + 1, cupy.float32), ValueError),
    "slopes_batch_shape": ("alibi_slopes", lambda: cupy.ones((B + 1, H), cupy.float32), ValueError),
    "slopes_kv_heads": ("alibi_slopes", lambda: cupy.ones(HKV, cupy.float32), ValueError),
    "slopes_numpy": ("alibi_slopes", lambda: np.ones(H, np.float32), TypeError),
}


def small_inputs():
    """Device (dout, q, k, v, out, lse) from a plain forward pass."""
    dout, q = (cupy.zeros((B, NQ, H, D), cupy.float16) for _ in range(2))
    k, v = (cupy.zeros((B, NK, HKV, D), cupy.float16) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("entry", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("case", BAD)
def test_bad_option(entry, case):
    arg, make, error = BAD[case]
    dout, q, k, v, out, lse = small_inputs()
    call = {
        "attention": lambda **kw: cuflash.attention(q, k, v, **kw),
        "attention_backward": lambda **kw: cuflash.attention_backward(dout, q, k, v, out, lse, **kw),
        "attention_vjp": lambda **kw: cuflash.attention_vjp(q, k, v, **kw),
    }[entry]
    with pytest.raises(error, match=mentions(arg)):
        call(**{arg: make()})


@pytest.mark.hopper
def test_fp8_rejects_alibi(rng):
    bits_, descales, _ = fp8_inputs(rng, B, NQ, NK, H, HKV, D)
    with pytest.raises((TypeError, ValueError), match=mentions("alibi_slopes")):
        cuflash.attention(*bits_, alibi_slopes=cupy.ones(H, cupy.float32), **descales)
