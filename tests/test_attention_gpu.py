"""Correctness of cuflash.attention against the float64 reference.

Accuracy rule: the kernel's max abs error against the float64 reference may
be at most twice that of the naive computation in the input dtype (see
cuflash.reference.attention_naive_lowp), plus a small atol.

Inputs are built on the host in the low-precision dtype and copied to the
device, so the references see exactly the values the kernel sees.
"""


import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.reference import attention as reference
from cuflash.reference import attention_naive_lowp
from tests.numerics import check_lse, assert_close_2x, ATOL, DTYPES, make_qkv, randn

pytestmark = pytest.mark.gpu



def expected(q, k, v, **kwargs):
    """(float64 output, float64 lse, naive low-precision output) for host inputs."""
    ref, lse = reference(q, k, v, return_lse=True, **kwargs)
    naive = attention_naive_lowp(q, k, v, dtype=q.dtype, **kwargs)
    return ref, lse, naive


def check(host, dev, **kwargs):
    """Run the kernel on dev inputs and hold it to the 2x rule."""
    out = cuflash.attention(*dev, **kwargs)
    assert out.shape == dev[0].shape and out.dtype == dev[0].dtype
    ref, _, naive = expected(*host, **kwargs)
    assert_close_2x(out.get(), ref, naive, ATOL[out.dtype])



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims(rng, dtype, headdim, causal):
    host, dev = make_qkv(rng, dtype, 2, 97, 97, 2, 2, headdim)
    check(host, dev, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nq,nk",
    [(1, 1), (17, 17), (97, 97), (257, 257), (1025, 1025),
     (17, 257), (257, 17), (1, 1025), (1025, 97)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(rng, dtype, nq, nk, causal):
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 2, 2, 64)
    check(host, dev, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_kv", [2, 1])
@pytest.mark.parametrize("nq,nk", [(97, 129), (129, 97)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(rng, dtype, nheads_kv, nq, nk, causal):
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 4, nheads_kv, 64)
    check(host, dev, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax_scale", [0.3, 2.0])
def test_softmax_scale(rng, dtype, softmax_scale):
    host, dev = make_qkv(rng, dtype, 2, 97, 129, 2, 2, 64)
    check(host, dev, causal=True, softmax_scale=softmax_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhnd", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs(rng, dtype, layout, causal):
    batch, nq, nk, nheads, headdim = 2, 65, 97, 2, 64
    if layout == "bhnd":
        # Each tensor stored as (batch, nheads, seqlen, headdim).
        bases = [
            randn(rng, (batch, nheads, n, headdim), dtype) for n in (nq, nk, nk)
        ]
        host = tuple(x.transpose(0, 2, 1, 3) for x in bases)
        dev = tuple(cupy.asarray(x).transpose(0, 2, 1, 3) for x in bases)
    else:
        # q: the second half of the heads of a wider tensor (non-zero offset);
        # k, v: interleaved in one (batch, seqlen, 2, nheads, headdim) tensor.
        q_base = randn(rng, (batch, nq, 2 * nheads, headdim), dtype)
        kv_base = randn(rng, (batch, nk, 2, nheads, headdim), dtype)
        q_dev, kv_dev = cupy.asarray(q_base), cupy.asarray(kv_base)
        host = (q_base[:, :, nheads:], kv_base[:, :, 0], kv_base[:, :, 1])
        dev = (q_dev[:, :, nheads:], kv_dev[:, :, 0], kv_dev[:, :, 1])
    check(host, dev, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_layout", ["contiguous", "every_other_head"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_out_argument(rng, dtype, out_layout, return_lse):
    batch, nq, nk, nheads, headdim = 2, 97, 97, 2, 64
    host, dev = make_qkv(rng, dtype, batch, nq, nk, nheads, nheads, headdim)
    # Poison the whole buffer so unwritten elements show up as NaN.
    wide = 1 if out_layout == "contiguous" else 2
    storage = cupy.asarray(np.full((batch, nq, wide * nheads, headdim), np.nan, dtype))
    out = storage[:, :, ::wide]

    result = cuflash.attention(*dev, causal=True, out=out, return_lse=return_lse)
    if return_lse:
        result, lse = result
    assert result is out

    ref, ref_lse, naive = expected(*host, causal=True)
    written = storage.get()
    assert_close_2x(written[:, :, ::wide], ref, naive, ATOL[out.dtype])
    if out_layout == "every_other_head":
        assert np.isnan(written[:, :, 1::2].astype(np.float32)).all()  # untouched
    if return_lse:
        check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(97, 97), (17, 257), (257, 17)])
def test_lse(rng, dtype, causal, nq, nk):
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 4, 2, 64)
    out, lse = cuflash.attention(*dev, causal=causal, return_lse=True)
    ref, ref_lse, naive = expected(*host, causal=causal)
    assert_close_2x(out.get(), ref, naive, ATOL[out.dtype])
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nk", [(257, 17), (64, 1)])
def test_fully_masked_rows(rng, dtype, nq, nk):
    # Causal with nq > nk: the first nq - nk query rows see no key.
    host, dev = make_qkv(rng, dtype, 2, nq, nk, 2, 2, 64)
    out, lse = cuflash.attention(*dev, causal=True, return_lse=True)
    out, lse = out.get().astype(np.float64), lse.get().astype(np.float64)
    masked = nq - nk
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[:, :masked] == 0)
    assert np.all(np.isneginf(lse[:, :, :masked]))
    ref, _, naive = expected(*host, causal=True)
    assert_close_2x(out, ref, naive, ATOL[np.dtype(dtype)])


def test_non_default_stream(rng):
    _, dev = make_qkv(rng, np.float16, 2, 257, 257, 4, 2, 64)
    want = cuflash.attention(*dev, causal=True).get()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Copies queued on the stream: the kernel must be ordered after them.
        out = cuflash.attention(*(x.copy() for x in dev), causal=True)
        got = out.get()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence(rng, dtype, causal):
    host, dev = make_qkv(rng, dtype, 1, 4096, 4096, 1, 1, 128)
    check(host, dev, causal=causal)


def test_repeated_calls_take_the_launch_plan(rng, monkeypatch):
    """A call with the signature of an earlier one reuses its launch plan
    (validation and dispatch skipped) and is as exact; another mask, scale,
    dtype or stride layout makes a plan of its own, misaligned inputs are
    copied as on the full path, and bad arguments of a planned shape still
    raise."""
    from cuflash import dispatch, forward, validate

    host, dev = make_qkv(rng, np.float16, 2, 97, 130, 4, 2, 64)
    check(host, dev)
    assert len(forward._plans) == 1
    check(host, dev, causal=True)
    check(host, dev, softmax_scale=0.3)
    host16, dev16 = make_qkv(rng, ml_dtypes.bfloat16, 2, 97, 130, 4, 2, 64)
    check(host16, dev16)
    # A strided view of the same shape (heads sliced out of a wider array).
    wide_host, wide_dev = make_qkv(rng, np.float16, 2, 97, 130, 8, 4, 64)
    view_host = tuple(x[:, :, ::2] for x in wide_host)
    view_dev = tuple(x[:, :, ::2] for x in wide_dev)
    check(view_host, view_dev)
    # A q whose base pointer is 2 bytes off: the kernel gets a contiguous copy.
    flat = cupy.zeros(dev[0].size + 1, np.float16)
    shifted = flat[1:].reshape(dev[0].shape)
    shifted[...] = dev[0]
    check(host, (shifted, dev[1], dev[2]))
    assert len(forward._plans) == 6
    with pytest.raises(TypeError, match=r"\bk\b"):
        cuflash.attention(dev[0], dev16[1], dev[2])

    # The repeated signatures now run without validation or dispatch.
    def must_not_run(*args, **kwargs):
        raise AssertionError("a planned call validated or dispatched again")

    monkeypatch.setattr(validate, "qkv", must_not_run)
    monkeypatch.setattr(dispatch, "fwd_config", must_not_run)
    host, dev = make_qkv(rng, np.float16, 2, 97, 130, 4, 2, 64)
    check(host, dev)
    check(host, dev, causal=True)
    check(view_host, view_dev)
    shifted[...] = dev[0]
    check(host, (shifted, dev[1], dev[2]))
