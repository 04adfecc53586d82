"""The float64 reference against a brute-force statement of the maths."""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from scipy.special import logsumexp

from cuflash.reference import (
    attention,
    attention_backward,
    attention_backward_naive_lowp,
    attention_naive_lowp,
)


def brute_force(q, k, v, causal, scale):
    """One query row at a time, straight from the definition."""
    batch, nq, nheads, headdim = q.shape
    nk, nheads_kv = k.shape[1], k.shape[2]
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    mask = j <= i + nk - nq if causal else np.ones((nq, nk), dtype=bool)
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, nq), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for row in range(nq):
                keys = np.flatnonzero(mask[row])
                if keys.size == 0:
                    continue
                scores = np.array([scale * np.dot(q[b, row, h], k[b, col, hk]) for col in keys])
                weights = np.exp(scores - scores.max())
                lse[b, h, row] = scores.max() + math.log(weights.sum())
                out[b, row, h] = weights @ v[b, keys, hk] / weights.sum()
    return out, lse


def random_qkv(batch, nq, nk, nheads, nheads_kv, headdim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, nq, nheads, headdim))
    k = rng.standard_normal((batch, nk, nheads_kv, headdim))
    v = rng.standard_normal((batch, nk, nheads_kv, headdim))
    return q, k, v


@pytest.mark.parametrize("headdim", [8, 64])
@pytest.mark.parametrize("nheads,nheads_kv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(16, 16), (7, 23), (23, 7), (1, 9), (9, 1)])
def test_matches_brute_force(nq, nk, causal, nheads, nheads_kv, headdim):
    q, k, v = random_qkv(2, nq, nk, nheads, nheads_kv, headdim, seed=nq * 100 + nk)
    scale = 0.37
    out, lse = attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    want_out, want_lse = brute_force(q, k, v, causal, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows():
    # Causal with nq > nk: row i sees keys j <= i - 5, so rows 0..4 see nothing.
    q, k, v = random_qkv(2, 9, 4, 2, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero / invalid-value warnings
        out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[:, :5] == 0)
    assert np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:]))
    assert np.all(np.any(out[:, 5:] != 0, axis=-1))


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = random_qkv(1, 5, 6, 2, 1, 64)
    out = attention(q, k, v)
    want, _ = brute_force(q, k, v, causal=False, scale=1 / 8)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = random_qkv(2, 11, 13, 3, 3, 16)
    scale = 0.5
    _, lse = attention(q, k, v, softmax_scale=scale, return_lse=True)
    scores = scale * np.einsum("bihd,bjhd->bhij", q, k)
    np.testing.assert_allclose(lse, logsumexp(scores, axis=-1), rtol=1e-12)


def test_output_dtype_is_float64():
    q, k, v = (x.astype(np.float16) for x in random_qkv(1, 4, 4, 1, 1, 8))
    out, lse = attention(q, k, v, return_lse=True)
    assert out.dtype == np.float64 and out.shape == q.shape
    assert lse.dtype == np.float64 and lse.shape == (1, 1, 4)


@pytest.mark.parametrize(
    "dtype,max_rel_err", [(np.float16, 1e-2), (ml_dtypes.bfloat16, 5e-2)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_naive_lowp_error_is_small_but_nonzero(dtype, max_rel_err, causal):
    q, k, v = (x.astype(dtype) for x in random_qkv(2, 64, 80, 4, 2, 64))
    ref = attention(q, k, v, causal=causal)
    naive = attention_naive_lowp(q, k, v, causal=causal, dtype=dtype)
    rel_err = np.abs(naive - ref).max() / np.abs(ref).max()
    assert 0 < rel_err < max_rel_err


def test_naive_lowp_fully_masked_rows_are_zero():
    q, k, v = random_qkv(1, 9, 4, 2, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        naive = attention_naive_lowp(q, k, v, causal=True, dtype=np.float16)
    assert not np.isnan(naive).any()
    assert np.all(naive[:, :5] == 0)


# --- Backward ---------------------------------------------------------------


def finite_difference_grads(loss, arrays, step=1e-6):
    """Central differences of the scalar loss(*arrays) in every element."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + step
            up = loss(*arrays)
            x[idx] = saved - step
            down = loss(*arrays)
            x[idx] = saved
            g[idx] = (up - down) / (2 * step)
        grads.append(g)
    return grads


@pytest.mark.parametrize("nheads,nheads_kv", [(2, 1), (2, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 6), (7, 4), (1, 5), (5, 1)])
def test_backward_matches_finite_differences(nq, nk, causal, nheads, nheads_kv):
    # Causal with nq > nk, (7, 4) and (5, 1), includes rows that see no key.
    q, k, v = random_qkv(1, nq, nk, nheads, nheads_kv, 4, seed=nq * 10 + nk)
    g = np.random.default_rng(1).standard_normal(q.shape)
    scale = 0.7

    def loss(q, k, v):
        return float(np.sum(attention(q, k, v, causal=causal, softmax_scale=scale) * g))

    want = finite_difference_grads(loss, [q.copy(), k.copy(), v.copy()])
    got = attention_backward(g, q, k, v, causal=causal, softmax_scale=scale)
    for name, a, b, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == x.shape and a.dtype == np.float64, name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)
    if causal and nq > nk:
        assert np.all(got[0][:, : nq - nk] == 0)


def test_backward_default_scale_is_inverse_sqrt_headdim():
    q, k, v = random_qkv(1, 5, 6, 2, 1, 16)
    dout = np.random.default_rng(2).standard_normal(q.shape)
    got = attention_backward(dout, q, k, v, causal=True)
    want = attention_backward(dout, q, k, v, causal=True, softmax_scale=0.25)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_backward_rowsum_identity():
    # The kernels use rowsum(dO * out) in place of rowsum(dP * P).
    q, k, v = random_qkv(2, 7, 9, 2, 2, 8)
    dout = np.random.default_rng(3).standard_normal(q.shape)
    out = attention(q, k, v, causal=True)
    scores = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(8)
    scores = np.where(np.tri(7, 9, 2, dtype=bool), scores, -np.inf)
    p = np.exp(scores - logsumexp(scores, axis=-1, keepdims=True))
    dp = np.einsum("bihd,bjhd->bhij", dout, v)
    np.testing.assert_allclose(
        np.sum(dp * p, axis=-1), np.einsum("bihd,bihd->bhi", dout, out), rtol=1e-12, atol=1e-12
    )


def test_backward_fully_masked_rows():
    # Causal with nq > nk: rows 0..4 see no key and get zero gradients.  Row 5
    # sees one key, so its softmax is constant and its dq is 0 too.
    q, k, v = random_qkv(2, 9, 4, 4, 2, 8)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv = attention_backward(dout, q, k, v, causal=True)
        naive = attention_backward_naive_lowp(dout, q, k, v, causal=True, dtype=np.float16)
    for grads in ((dq, dk, dv), naive):
        assert not any(np.isnan(x).any() for x in grads)
        assert np.all(grads[0][:, :5] == 0)
        assert np.all(np.any(grads[0][:, 6:] != 0, axis=-1))
        assert np.abs(grads[0][:, 5]).max() <= 1e-6 * np.abs(grads[0]).max()
    # The masked rows' dout must not leak into dk and dv.
    dout[:, :5] = 1e3
    for a, b in zip((dk, dv), attention_backward(dout, q, k, v, causal=True)[1:]):
        np.testing.assert_array_equal(a, b)


def test_backward_gqa_sums_over_group():
    # nheads_kv = 1 equals nheads_kv = nheads with k, v repeated, dk and dv summed.
    q, k, v = random_qkv(1, 6, 8, 3, 1, 8)
    dout = np.random.default_rng(5).standard_normal(q.shape)
    dq, dk, dv = attention_backward(dout, q, k, v, causal=True)
    k3, v3 = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    dq3, dk3, dv3 = attention_backward(dout, q, k3, v3, causal=True)
    np.testing.assert_allclose(dq, dq3, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, dk3.sum(axis=2, keepdims=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dv3.sum(axis=2, keepdims=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "dtype,max_rel_err", [(np.float16, 2e-2), (ml_dtypes.bfloat16, 1e-1)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_naive_lowp_error_is_small_but_nonzero(dtype, max_rel_err, causal):
    q, k, v = (x.astype(dtype) for x in random_qkv(2, 64, 80, 4, 2, 64))
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(dtype)
    ref = attention_backward(dout, q, k, v, causal=causal)
    naive = attention_backward_naive_lowp(dout, q, k, v, causal=causal, dtype=dtype)
    for name, a, b, x in zip(("dq", "dk", "dv"), naive, ref, (q, k, v)):
        assert a.shape == x.shape and a.dtype == np.float32, name
        np.testing.assert_array_equal(a, a.astype(dtype).astype(np.float32))  # representable
        rel_err = np.abs(a - b).max() / np.abs(b).max()
        assert 0 < rel_err < max_rel_err, (name, rel_err)
