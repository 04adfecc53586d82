"""The float64 reference against a brute-force statement of the maths."""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from scipy.special import logsumexp

from cuflash.reference import attention, attention_naive_lowp


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
