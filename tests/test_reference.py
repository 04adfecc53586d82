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
    attention_naive_fp8,
    attention_naive_lowp,
    attention_probs,
    attention_varlen,
    attention_varlen_backward,
    attention_varlen_backward_naive_lowp,
    attention_varlen_naive_lowp,
    apply_rotary,
    causal_mask,
    dropout_keep_mask,
    kvcache_sequences,
    philox4x32,
    visible_mask,
)
from cuflash.score_mods import DROPOUT_DRAW_BITS, queries_rotate_apart


def sees(row, col, nq, nk, causal, window_size):
    """Whether query row sees key col, written out from the definition."""
    left, right = window_size
    if causal:
        right = 0
    diagonal = row + nk - nq
    return (left < 0 or col >= diagonal - left) and (right < 0 or col <= diagonal + right)


def brute_force(q, k, v, causal, scale, window_size=(-1, -1), softcap=0.0, slopes=None):
    """One query row at a time, straight from the definition; slopes: (batch, nheads) or None."""
    batch, nq, nheads, headdim = q.shape
    nk, nheads_kv = k.shape[1], k.shape[2]

    def score(b, h, hk, row, col):
        s = scale * np.dot(q[b, row, h], k[b, col, hk])
        if softcap > 0:
            s = softcap * math.tanh(s / softcap)
        if slopes is not None:
            s -= slopes[b][h] * abs(row + nk - nq - col)
        return s

    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, nq), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for row in range(nq):
                keys = np.array([col for col in range(nk) if sees(row, col, nq, nk, causal, window_size)], int)
                if keys.size == 0:
                    continue
                scores = np.array([score(b, h, hk, row, col) for col in keys])
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
    # sees one key, so its softmax is constant and its dq is 0 too: exactly in
    # float64, and within the rounding of out and dP in the naive fp16 one.
    q, k, v = random_qkv(2, 9, 4, 4, 2, 8)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv = attention_backward(dout, q, k, v, causal=True)
        naive = attention_backward_naive_lowp(dout, q, k, v, causal=True, dtype=np.float16)
    for grads, rel in (((dq, dk, dv), 1e-6), (naive, 2 * np.finfo(np.float16).eps)):
        assert not any(np.isnan(x).any() for x in grads)
        assert np.all(grads[0][:, :5] == 0)
        assert np.all(np.any(grads[0][:, 6:] != 0, axis=-1))
        assert np.abs(grads[0][:, 5]).max() <= rel * np.abs(grads[0]).max()
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


# --- Sliding window, softcap and ALiBi --------------------------------------


def test_visible_mask_window():
    # Square: the band of keys within one to the left and two to the right of the diagonal.
    want = np.array(
        [[1, 1, 1, 0, 0],
         [1, 1, 1, 1, 0],
         [0, 1, 1, 1, 1],
         [0, 0, 1, 1, 1],
         [0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(visible_mask(5, 5, window_size=(1, 2)), want)
    np.testing.assert_array_equal(visible_mask(5, 5, window_size=(-1, 2)), np.tri(5, 5, 2, dtype=bool))
    np.testing.assert_array_equal(visible_mask(5, 5, window_size=(1, -1)), np.tri(5, 5, 1, dtype=bool).T)


def test_visible_mask_window_and_causal():
    # Nq < Nk: query i's diagonal is key i + 2; causal overrides the right bound 3 with 0.
    want = np.array(
        [[0, 1, 1, 0, 0, 0],
         [0, 0, 1, 1, 0, 0],
         [0, 0, 0, 1, 1, 0],
         [0, 0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(visible_mask(4, 6, causal=True, window_size=(1, 3)), want)
    np.testing.assert_array_equal(visible_mask(4, 6, window_size=(1, 0)), want)


def test_visible_mask_rows_without_keys():
    # Nq > Nk: query i's diagonal is key i - 4, so it sees keys i - 5 .. i - 3; rows 0..2 see none.
    want = np.array(
        [[0, 0, 0],
         [0, 0, 0],
         [0, 0, 0],
         [1, 0, 0],
         [1, 1, 0],
         [1, 1, 1],
         [0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(visible_mask(7, 3, window_size=(1, 1)), want)


@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (4, 9), (9, 4)])
def test_visible_mask_special_windows(nq, nk):
    full = np.ones((nq, nk), dtype=bool)
    causal = np.tri(nq, nk, nk - nq, dtype=bool)
    np.testing.assert_array_equal(visible_mask(nq, nk), full)
    np.testing.assert_array_equal(visible_mask(nq, nk, window_size=(nq + nk, nq + nk)), full)
    np.testing.assert_array_equal(visible_mask(nq, nk, window_size=(-1, 0)), causal)
    np.testing.assert_array_equal(visible_mask(nq, nk, causal=True), causal)
    np.testing.assert_array_equal(visible_mask(nq, nk, causal=True, window_size=(nq + nk, -1)), causal)
    np.testing.assert_array_equal(causal_mask(nq, nk), causal)


def test_softcap_hand_computed():
    # One query, keys 1 and 0, scale 1: scores (2, 0) become (tanh 2, 0) with softcap 1.
    q, k, v = (np.array(x, float).reshape(1, -1, 1, 1) for x in ([2.0], [1.0, 0.0], [1.0, 0.0]))
    out, lse = attention(q, k, v, softcap=1.0, softmax_scale=1.0, return_lse=True)
    t = math.tanh(2.0)
    assert out[0, 0, 0, 0] == pytest.approx(math.exp(t) / (math.exp(t) + 1), rel=1e-14)
    assert lse[0, 0, 0] == pytest.approx(math.log(math.exp(t) + 1), rel=1e-14)


def test_alibi_hand_computed():
    # Zero scores, one query and three keys: distances to the diagonal key 2 are 2, 1, 0.
    q, k = np.zeros((1, 1, 1, 8)), np.zeros((1, 3, 1, 8))
    v = np.arange(3.0).reshape(1, 3, 1, 1) * np.ones(8)
    out, lse = attention(q, k, v, alibi_slopes=np.array([0.5], np.float32), return_lse=True)
    weights = np.exp([-1.0, -0.5, 0.0])
    assert lse[0, 0, 0] == pytest.approx(math.log(weights.sum()), rel=1e-14)
    np.testing.assert_allclose(out[0, 0, 0], weights @ np.arange(3.0) / weights.sum(), rtol=1e-14)


def test_softcap_comes_before_alibi():
    # Scores (3, 3), softcap 2, slope 1, distances (1, 0): (c - 1, c) with c = 2 tanh(1.5).
    q, k = np.full((1, 1, 1, 1), 3.0), np.ones((1, 2, 1, 1))
    _, lse = attention(q, k, k, softcap=2.0, alibi_slopes=[1.0], softmax_scale=1.0, return_lse=True)
    c = 2 * math.tanh(1.5)
    assert lse[0, 0, 0] == pytest.approx(c + math.log(1 + math.exp(-1)), rel=1e-14)


class DeviceSlopes:
    """Stands in for a CuPy array: np.asarray would not take it, .get() gives the host copy."""

    def __init__(self, host):
        self.host = host

    def get(self):
        return self.host

    def __array__(self, *args, **kwargs):
        raise TypeError("device memory")


def test_alibi_slope_shapes():
    q, k, v = random_qkv(2, 5, 7, 4, 2, 8)
    per_head = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    want = attention(q, k, v, alibi_slopes=np.tile(per_head, (2, 1)))
    np.testing.assert_array_equal(attention(q, k, v, alibi_slopes=per_head), want)
    np.testing.assert_array_equal(attention(q, k, v, alibi_slopes=per_head.tolist()), want)
    np.testing.assert_array_equal(attention(q, k, v, alibi_slopes=DeviceSlopes(per_head)), want)
    np.testing.assert_array_equal(attention(q, k, v, alibi_slopes=np.zeros(4)), attention(q, k, v))
    assert np.abs(want - attention(q, k, v)).max() > 1e-3
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention(q, k, v, alibi_slopes=np.ones((2, 2)))


def test_softcap_off_and_large():
    q, k, v = random_qkv(1, 6, 9, 2, 1, 8)
    plain = attention(q, k, v, causal=True)
    np.testing.assert_array_equal(attention(q, k, v, causal=True, softcap=0.0), plain)
    np.testing.assert_allclose(attention(q, k, v, causal=True, softcap=1e6), plain, rtol=1e-9, atol=1e-12)
    assert np.abs(attention(q, k, v, causal=True, softcap=0.5) - plain).max() > 1e-3


OPTIONS = [
    dict(window_size=(2, 1)),
    dict(window_size=(3, -1), causal=True),
    dict(window_size=(-1, 2)),
    dict(softcap=0.8),
    dict(alibi_slopes=np.array([0.3, 0.7, 1.1, 0.05], np.float32)),
    dict(alibi_slopes=np.array([[0.3, 0.7, 1.1, 0.05], [0.9, 0.0, 0.2, 0.4]], np.float32), causal=True),
    dict(window_size=(2, 0), softcap=1.5, alibi_slopes=np.array([0.2, 0.4, 0.6, 0.8], np.float32)),
]


def slopes_2d(options, batch, nheads):
    slopes = options.get("alibi_slopes")
    return None if slopes is None else np.broadcast_to(slopes, (batch, nheads))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq,nk", [(6, 6), (4, 9), (9, 4), (1, 5)])
def test_options_match_brute_force(options, nq, nk):
    q, k, v = random_qkv(2, nq, nk, 4, 2, 8, seed=nq * 10 + nk)
    scale = 0.6
    out, lse = attention(q, k, v, softmax_scale=scale, return_lse=True, **options)
    want_out, want_lse = brute_force(
        q, k, v, options.get("causal", False), scale, options.get("window_size", (-1, -1)),
        options.get("softcap", 0.0), slopes_2d(options, 2, 4))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_window_rows_without_keys():
    # Window (2, 1) with nq = 9, nk = 4: query i sees keys up to i - 4, so rows 0..3 see none.
    q, k, v = random_qkv(2, 9, 4, 2, 2, 8)
    options = dict(window_size=(2, 1), softcap=1.0, alibi_slopes=np.array([0.5, 1.0], np.float32))
    dout = np.random.default_rng(7).standard_normal(q.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(q, k, v, return_lse=True, **options)
        naive = attention_naive_lowp(q, k, v, dtype=np.float16, **options)
        grads = attention_backward(dout, q, k, v, **options)
        naive_grads = attention_backward_naive_lowp(dout, q, k, v, dtype=np.float16, **options)
    assert np.all(out[:, :4] == 0) and np.all(naive[:, :4] == 0)
    assert np.all(np.isneginf(lse[:, :, :4])) and np.all(np.isfinite(lse[:, :, 4:]))
    for g in (*grads, *naive_grads):
        assert not np.isnan(g).any()
    assert np.all(grads[0][:, :4] == 0) and np.all(naive_grads[0][:, :4] == 0)


def random_coordinates(rng, shape, count):
    return [tuple(int(rng.integers(n)) for n in shape) for _ in range(count)]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5)])
def test_options_backward_matches_finite_differences(options, nq, nk):
    # GQA (4 query heads on 2 kv heads), Nq != Nk, central differences at random coordinates.
    q, k, v = random_qkv(2, nq, nk, 4, 2, 8, seed=nq * 10 + nk)
    g = np.random.default_rng(1).standard_normal(q.shape)
    scale, step = 0.7, 1e-6

    def loss():
        return float(np.sum(attention(q, k, v, softmax_scale=scale, **options) * g))

    got = attention_backward(g, q, k, v, softmax_scale=scale, **options)
    rng = np.random.default_rng(2)
    for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), got):
        assert grad.shape == x.shape and grad.dtype == np.float64, name
        for idx in random_coordinates(rng, x.shape, 12):
            saved = x[idx]
            x[idx] = saved + step
            up = loss()
            x[idx] = saved - step
            down = loss()
            x[idx] = saved
            want = (up - down) / (2 * step)
            assert grad[idx] == pytest.approx(want, rel=1e-6, abs=1e-7), (name, idx)


@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_softcap_backward_matches_finite_differences_everywhere(softcap):
    q, k, v = random_qkv(1, 4, 6, 2, 1, 4, seed=3)
    g = np.random.default_rng(4).standard_normal(q.shape)
    options = dict(causal=True, window_size=(3, -1), softcap=softcap, alibi_slopes=[0.25, 0.5])

    def loss(q, k, v):
        return float(np.sum(attention(q, k, v, **options) * g))

    want = finite_difference_grads(loss, [q.copy(), k.copy(), v.copy()])
    got = attention_backward(g, q, k, v, **options)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("dtype,max_rel_err", [(np.float16, 2e-2), (ml_dtypes.bfloat16, 1e-1)])
@pytest.mark.parametrize("options", OPTIONS)
def test_options_naive_lowp_close_to_float64(dtype, max_rel_err, options):
    q, k, v = (x.astype(dtype) for x in random_qkv(2, 48, 64, 4, 2, 64))
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(dtype)
    ref = attention(q, k, v, **options)
    naive = attention_naive_lowp(q, k, v, dtype=dtype, **options)
    assert 0 < np.abs(naive - ref).max() / np.abs(ref).max() < max_rel_err
    refs = attention_backward(dout, q, k, v, **options)
    naives = attention_backward_naive_lowp(dout, q, k, v, dtype=dtype, **options)
    for name, a, b in zip(("dq", "dk", "dv"), naives, refs):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, a.astype(dtype).astype(np.float32))  # representable
        rel_err = np.abs(a - b).max() / np.abs(b).max()
        assert 0 < rel_err < max_rel_err, (name, rel_err)


@pytest.mark.parametrize(
    "options", [dict(window_size=(5, 3)), dict(softcap=2.0, causal=True), dict(window_size=(8, 0), softcap=1.0)]
)
def test_naive_fp8_options_close_to_float64(options):
    q, k, v = random_qkv(2, 40, 56, 4, 2, 64)
    ref = attention(q, k, v, **options)
    naive = attention_naive_fp8(q, k, v, **options)
    assert 0 < np.abs(naive - ref).max() / np.abs(ref).max() < 5e-2


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(3, 2), softcap=2.0),
                                     dict(alibi=True, causal=True, window_size=(4, -1))])
def test_attention_probs_are_attention_of_one_hot_values(options):
    """attention_probs' row i is the output of query i when key j's value is the j-th unit vector;
    a query that sees no key (causal, seqlen_q > seqlen_k) has a row of zeros."""
    options = dict(options)
    batch, nq, nk, nheads = 2, 9, 6, 4
    q, k, _ = random_qkv(batch, nq, nk, nheads, 2, nk, seed=3)  # v (one-hot) has head dim nk, as q
    if options.pop("alibi", False):
        options["alibi_slopes"] = np.random.default_rng(4).uniform(0.1, 1.0, (batch, nheads))
    one_hot = np.broadcast_to(np.eye(nk)[None, :, None, :], (batch, nk, 2, nk))
    probs = attention_probs(q, k, **options)
    assert probs.shape == (batch, nheads, nq, nk)
    np.testing.assert_allclose(probs, attention(q, k, one_hot, **options).transpose(0, 2, 1, 3), atol=1e-15)
    if options.get("causal"):
        assert not probs[:, :, :nq - nk].any()
    sums = probs.sum(axis=-1)
    np.testing.assert_allclose(sums[sums > 0], 1.0, rtol=1e-12)


# --- Dropout from a keep mask -------------------------------------------------


def brute_force_dropout(q, k, v, causal, scale, mask, dropout_p, window_size=(-1, -1), softcap=0.0, slopes=None):
    """out = sum over kept visible keys of P[i, j] / (1 - p) * v[j], one row at a time; lse undropped."""
    batch, nq, nheads, _ = q.shape
    nk, nheads_kv = k.shape[1], k.shape[2]
    _, lse = brute_force(q, k, v, causal, scale, window_size, softcap, slopes)
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for row in range(nq):
                for col in range(nk):
                    if not sees(row, col, nq, nk, causal, window_size) or not mask[b, h, row, col]:
                        continue
                    s = scale * np.dot(q[b, row, h], k[b, col, hk])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b][h]) * abs(row + nk - nq - col)
                    out[b, row, h] += math.exp(s - lse[b, h, row]) / (1 - dropout_p) * v[b, col, hk]
    return out, lse


def random_mask(shape, keep=0.7, seed=0):
    return np.random.default_rng(seed).random(shape) < keep


def test_dropout_hand_computed():
    # One query, two keys with equal scores: P = (1/2, 1/2); keep only key 1, p = 0.5.
    q = np.zeros((1, 1, 1, 2))
    k = np.zeros((1, 2, 1, 2))
    v = np.array([3.0, 5.0]).reshape(1, 2, 1, 1) * np.ones((1, 2, 1, 2))
    mask = np.array([False, True]).reshape(1, 1, 1, 2)
    out, lse = attention(q, k, v, return_lse=True, dropout_mask=mask, dropout_p=0.5)
    np.testing.assert_allclose(out[0, 0, 0], [5.0, 5.0])  # (1/2) / (1 - 1/2) * 5
    np.testing.assert_allclose(lse[0, 0, 0], math.log(2))  # undropped
    out = attention(q, k, v, dropout_mask=~mask, dropout_p=0.75)
    np.testing.assert_allclose(out[0, 0, 0], [6.0, 6.0])  # (1/2) / (1/4) * 3


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq,nk", [(5, 7), (7, 3)])
def test_dropout_matches_brute_force(options, nq, nk):
    q, k, v = random_qkv(2, nq, nk, 4, 2, 8, seed=nq * 10 + nk)
    mask = random_mask((2, 4, nq, nk), seed=nq)
    scale, p = 0.6, 0.3
    out, lse = attention(q, k, v, softmax_scale=scale, return_lse=True, dropout_mask=mask, dropout_p=p, **options)
    want_out, want_lse = brute_force_dropout(
        q, k, v, options.get("causal", False), scale, mask, p, options.get("window_size", (-1, -1)),
        options.get("softcap", 0.0), slopes_2d(options, 2, 4))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_dropout_all_kept():
    q, k, v = random_qkv(2, 5, 6, 2, 1, 8)
    dout = np.random.default_rng(3).standard_normal(q.shape)
    ones = np.ones((2, 2, 5, 6), bool)
    plain, plain_lse = attention(q, k, v, causal=True, return_lse=True)
    out, lse = attention(q, k, v, causal=True, return_lse=True, dropout_mask=ones, dropout_p=0.0)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    out = attention(q, k, v, causal=True, return_lse=False, dropout_mask=ones, dropout_p=0.5)
    np.testing.assert_allclose(out, 2 * plain, rtol=1e-14)
    for a, b in zip(attention_backward(dout, q, k, v, causal=True, dropout_mask=ones),
                    attention_backward(dout, q, k, v, causal=True)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


def test_dropout_nothing_kept():
    q, k, v = random_qkv(1, 4, 5, 2, 2, 8)
    none = np.zeros((1, 2, 4, 5), bool)
    out, lse = attention(q, k, v, return_lse=True, dropout_mask=none, dropout_p=0.2)
    assert np.all(out == 0)
    np.testing.assert_allclose(lse, attention(q, k, v, return_lse=True)[1])
    for g in attention_backward(np.ones(q.shape), q, k, v, dropout_mask=none, dropout_p=0.2):
        assert np.all(g == 0)


@pytest.mark.parametrize("options", [dict(), dict(causal=True), *OPTIONS[3:]])
@pytest.mark.parametrize("nq,nk", [(4, 5), (6, 3)])
def test_dropout_backward_matches_finite_differences(options, nq, nk):
    # The function of q, k, v with the mask held fixed; GQA, 4 query heads on 2 kv heads.
    q, k, v = random_qkv(2, nq, nk, 4, 2, 4, seed=nq * 10 + nk)
    g = np.random.default_rng(1).standard_normal(q.shape)
    drop = dict(dropout_mask=random_mask((2, 4, nq, nk), keep=0.6, seed=nk), dropout_p=0.4)

    def loss(q, k, v):
        return float(np.sum(attention(q, k, v, softmax_scale=0.7, **drop, **options) * g))

    want = finite_difference_grads(loss, [q.copy(), k.copy(), v.copy()])
    got = attention_backward(g, q, k, v, softmax_scale=0.7, **drop, **options)
    for name, a, b, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == x.shape and a.dtype == np.float64, name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)


def test_dropout_backward_rowsum_identity():
    # rowsum(dO * out) of the dropped out equals rowsum(dP * P) with the dropped dP.
    q, k, v = random_qkv(1, 5, 6, 1, 1, 8, seed=5)
    mask = random_mask((1, 1, 5, 6), seed=5)
    dout = np.random.default_rng(6).standard_normal(q.shape)
    out, lse = attention(q, k, v, return_lse=True, dropout_mask=mask, dropout_p=0.25)
    s = (q[0, :, 0] @ k[0, :, 0].T) / math.sqrt(8)
    p = np.exp(s - lse[0, 0][:, None])
    dp = (dout[0, :, 0] @ v[0, :, 0].T) * mask[0, 0] / 0.75
    np.testing.assert_allclose((dp * p).sum(-1), (dout * out)[0, :, 0].sum(-1), rtol=1e-12)


@pytest.mark.parametrize("dtype,max_rel_err", [(np.float16, 2e-2), (ml_dtypes.bfloat16, 1e-1)])
def test_dropout_naive_lowp_close_to_float64(dtype, max_rel_err):
    q, k, v = (x.astype(dtype) for x in random_qkv(2, 48, 64, 4, 2, 64))
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(dtype)
    drop = dict(dropout_mask=random_mask((2, 4, 48, 64), keep=0.8), dropout_p=0.2, causal=True)
    ref = attention(q, k, v, **drop)
    naive = attention_naive_lowp(q, k, v, dtype=dtype, **drop)
    assert naive.dtype == np.float32
    err = np.abs(naive - ref).max() / np.abs(ref).max()
    assert 0 < err < max_rel_err
    assert np.array_equal(naive, naive.astype(dtype).astype(np.float32))
    for got, want in zip(attention_backward_naive_lowp(dout, q, k, v, dtype=dtype, **drop),
                         attention_backward(dout, q, k, v, **drop)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert 0 < err < max_rel_err
        assert np.array_equal(got, got.astype(dtype).astype(np.float32))


def test_dropout_naive_lowp_without_mask_unchanged():
    q, k, v = random_qkv(1, 6, 7, 2, 1, 16)
    ones = np.ones((1, 2, 6, 7), bool)
    np.testing.assert_array_equal(attention_naive_lowp(q, k, v, dtype=np.float16),
                                  attention_naive_lowp(q, k, v, dtype=np.float16, dropout_mask=ones))
    for a, b in zip(attention_backward_naive_lowp(q, q, k, v, dtype=np.float16),
                    attention_backward_naive_lowp(q, q, k, v, dtype=np.float16, dropout_mask=ones)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fn", [attention, attention_backward, attention_naive_lowp, attention_backward_naive_lowp])
def test_dropout_bad_arguments(fn):
    q, k, v = random_qkv(1, 3, 4, 2, 2, 8)
    extra = dict(dtype=np.float16) if "lowp" in fn.__name__ else {}
    call = (lambda **kw: fn(q, q, k, v, **extra, **kw)) if "backward" in fn.__name__ else \
        (lambda **kw: fn(q, k, v, **extra, **kw))
    with pytest.raises(ValueError, match="dropout_mask"):
        call(dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_mask"):
        call(dropout_mask=np.ones((1, 2, 4, 3), bool), dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_mask"):
        call(dropout_mask=np.ones((1, 2, 3, 4)), dropout_p=0.1)
    for p in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            call(dropout_mask=np.ones((1, 2, 3, 4), bool), dropout_p=p)



# Random123's published known-answer vectors for Philox4x32 (counter, key, output; 7 and 10 rounds).
PHILOX_KAT = {
    7: [((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A))],
    10: [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
         ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
         ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
          (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))],
}


@pytest.mark.parametrize("rounds", sorted(PHILOX_KAT))
def test_philox_known_answers(rounds):
    for counter, key, expected in PHILOX_KAT[rounds]:
        out = philox4x32([np.uint32(x) for x in counter], [np.uint32(x) for x in key], rounds)
        assert [int(x) for x in out] == list(expected)


def test_draws_compare_as_fp16_like_integers():
    """The kernels decide two elements at once with an fp16x2 compare of the 14-bit draws against the
    threshold (cuda_src/dropout.cuh, keep_halves): it must agree with the integer compare for every
    draw and every threshold from 0 to 2^14."""
    draws = np.arange(1 << DROPOUT_DRAW_BITS, dtype=np.uint16)
    as_fp16 = draws.view(np.float16)
    for threshold in (0, 1, 2, 1023, 1024, 1025, 14746, (1 << DROPOUT_DRAW_BITS) - 1, 1 << DROPOUT_DRAW_BITS):
        fp16_threshold = np.array([threshold], np.uint16).view(np.float16)[0]
        np.testing.assert_array_equal(as_fp16 < fp16_threshold, draws < threshold)


def test_keep_rate_is_one_minus_p():
    """Over 4.3 million elements the keep mask's rate is within 4 sigma of 1 - p, for p near 0, 0.1,
    0.5 and near 1, and each offset gives another mask."""
    for p in (0.01, 0.1, 0.5, 0.97):
        mask = dropout_keep_mask(11, 5, 2, 4, 512, 1056, p)
        sigma = math.sqrt(p * (1 - p) / mask.size)
        assert abs(mask.mean() - (1 - p)) < 4 * sigma
    assert (dropout_keep_mask(11, 5, 1, 1, 64, 64, 0.5) != dropout_keep_mask(11, 6, 1, 1, 64, 64, 0.5)).any()


# --- Variable-length batches --------------------------------------------------


def random_varlen(lens_q, lens_k, nheads, nheads_kv, headdim, seed=0):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), nheads, headdim))
    k = rng.standard_normal((int(cu_k[-1]), nheads_kv, headdim))
    v = rng.standard_normal((int(cu_k[-1]), nheads_kv, headdim))
    return q, k, v, cu_q, cu_k


VARLEN_LENGTHS = [
    ([5, 3, 7], [6, 3, 2]),
    ([4, 0, 2, 1], [3, 5, 0, 4]),  # empty query sequence; empty key sequence (its rows see nothing)
    ([0, 0], [0, 0]),
    ([1], [9]),
]


@pytest.mark.parametrize("options", [dict(), dict(causal=True), *OPTIONS])
@pytest.mark.parametrize("lens_q,lens_k", VARLEN_LENGTHS)
def test_varlen_matches_brute_force_per_sequence(options, lens_q, lens_k):
    q, k, v, cu_q, cu_k = random_varlen(lens_q, lens_k, 4, 2, 8, seed=len(lens_q))
    batch, scale = len(lens_q), 0.6
    slopes = options.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:  # one row per sequence
        options = dict(options, alibi_slopes=np.resize(slopes, (batch, 4)).astype(np.float32))
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=scale, return_lse=True, **options)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert out.dtype == lse.dtype == np.float64
    slopes = slopes_2d(options, batch, 4)
    for b in range(batch):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want_out, want_lse = brute_force(
            q[None, rq], k[None, rk], v[None, rk], options.get("causal", False), scale,
            options.get("window_size", (-1, -1)), options.get("softcap", 0.0),
            None if slopes is None else slopes[b : b + 1])
        np.testing.assert_allclose(out[rq], want_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, rq], want_lse[0], rtol=1e-12, atol=1e-12)
    assert np.array_equal(attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=scale, **options), out)


def test_varlen_equal_lengths_is_batched_attention():
    q, k, v = random_qkv(3, 5, 7, 4, 2, 16)
    cu_q = np.arange(0, 16, 5, dtype=np.int32)
    cu_k = np.arange(0, 22, 7, dtype=np.int32)
    options = dict(causal=True, alibi_slopes=np.random.default_rng(0).random((3, 4)).astype(np.float32))
    out, lse = attention(q, k, v, return_lse=True, **options)
    vout, vlse = attention_varlen(q.reshape(15, 4, 16), k.reshape(21, 2, 16), v.reshape(21, 2, 16), cu_q, cu_k,
                                  return_lse=True, **options)
    np.testing.assert_allclose(vout, out.reshape(15, 4, 16), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(vlse, lse.transpose(1, 0, 2).reshape(4, 15), rtol=1e-14)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    grads = attention_backward(dout, q, k, v, **options)
    vgrads = attention_varlen_backward(dout.reshape(15, 4, 16), q.reshape(15, 4, 16), k.reshape(21, 2, 16),
                                       v.reshape(21, 2, 16), cu_q, cu_k, **options)
    for a, b in zip(vgrads, grads):
        np.testing.assert_allclose(a, b.reshape(a.shape), rtol=1e-13, atol=1e-14)


def test_varlen_hand_computed():
    # Two sequences of one query each: the first sees keys {0, 1}, the second key {2} only.
    q = np.zeros((2, 1, 1))
    k = np.zeros((3, 1, 1))
    v = np.array([1.0, 3.0, 10.0]).reshape(3, 1, 1)
    cu_q, cu_k = np.array([0, 1, 2], np.int32), np.array([0, 2, 3], np.int32)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    np.testing.assert_allclose(out[:, 0, 0], [2.0, 10.0])
    np.testing.assert_allclose(lse[0], [math.log(2), 0.0])


def test_varlen_empty_key_sequence():
    q, k, v, cu_q, cu_k = random_varlen([3, 2], [0, 4], 2, 1, 8)
    dout = np.ones(q.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
        grads = attention_varlen_backward(dout, q, k, v, cu_q, cu_k)
        naive = attention_varlen_naive_lowp(q, k, v, cu_q, cu_k, dtype=np.float16)
    assert np.all(out[:3] == 0) and np.all(lse[:, :3] == -np.inf) and np.all(np.isfinite(lse[:, 3:]))
    assert np.all(naive[:3] == 0) and np.all(grads[0][:3] == 0)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(1, 0), softcap=0.9),
                                     dict(alibi_slopes=np.array([[0.3, 0.6], [0.1, 1.0], [0.5, 0.0]], np.float32))])
def test_varlen_backward_matches_finite_differences(options):
    q, k, v, cu_q, cu_k = random_varlen([3, 0, 4], [4, 2, 2], 2, 1, 4, seed=7)
    g = np.random.default_rng(8).standard_normal(q.shape)

    def loss(q, k, v):
        return float(np.sum(attention_varlen(q, k, v, cu_q, cu_k, **options) * g))

    want = finite_difference_grads(loss, [q.copy(), k.copy(), v.copy()])
    got = attention_varlen_backward(g, q, k, v, cu_q, cu_k, **options)
    for name, a, b, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == x.shape and a.dtype == np.float64, name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)


def test_varlen_dropout_uses_padded_mask_corners():
    lens_q, lens_k = [3, 0, 5], [4, 2, 3]
    q, k, v, cu_q, cu_k = random_varlen(lens_q, lens_k, 2, 2, 8, seed=9)
    mask = random_mask((3, 2, 6, 5), seed=9)  # padded beyond the longest lengths (5, 4)
    g = np.random.default_rng(10).standard_normal(q.shape)
    drop = dict(dropout_mask=mask, dropout_p=0.3, causal=True)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **drop)
    grads = attention_varlen_backward(g, q, k, v, cu_q, cu_k, **drop)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = dict(dropout_mask=mask[b : b + 1, :, :nq, :nk], dropout_p=0.3, causal=True)
        o, l = attention(q[None, rq], k[None, rk], v[None, rk], return_lse=True, **seq)
        np.testing.assert_array_equal(out[rq], o[0])
        np.testing.assert_array_equal(lse[:, rq], l[0])
        want = attention_backward(g[None, rq], q[None, rq], k[None, rk], v[None, rk], **seq)
        for got, w, rows in zip(grads, want, (rq, rk, rk)):
            np.testing.assert_array_equal(got[rows], w[0])

    def loss(q, k, v):
        return float(np.sum(attention_varlen(q, k, v, cu_q, cu_k, **drop) * g))

    want = finite_difference_grads(loss, [q.copy(), k.copy(), v.copy()])
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("dtype,max_rel_err", [(np.float16, 2e-2), (ml_dtypes.bfloat16, 1e-1)])
def test_varlen_naive_lowp_per_sequence(dtype, max_rel_err):
    lens_q, lens_k = [40, 0, 17, 64], [33, 8, 0, 64]
    q, k, v, cu_q, cu_k = random_varlen(lens_q, lens_k, 4, 2, 64, seed=11)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    dout = np.random.default_rng(12).standard_normal(q.shape).astype(dtype)
    options = dict(causal=True, softcap=2.0, dropout_mask=random_mask((4, 4, 64, 64), keep=0.9), dropout_p=0.1)
    naive = attention_varlen_naive_lowp(q, k, v, cu_q, cu_k, dtype=dtype, **options)
    naive_grads = attention_varlen_backward_naive_lowp(dout, q, k, v, cu_q, cu_k, dtype=dtype, **options)
    assert naive.dtype == np.float32 and naive.shape == q.shape
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = dict(options, dropout_mask=options["dropout_mask"][b : b + 1, :, :nq, :nk])
        want = attention_naive_lowp(q[None, rq], k[None, rk], v[None, rk], dtype=dtype, **seq)
        np.testing.assert_array_equal(naive[rq], want[0])
        want = attention_backward_naive_lowp(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], dtype=dtype,
                                             **seq)
        for got, w, rows in zip(naive_grads, want, (rq, rk, rk)):
            np.testing.assert_array_equal(got[rows], w[0])
    ref = attention_varlen(q, k, v, cu_q, cu_k, **options)
    assert 0 < np.abs(naive - ref).max() / np.abs(ref).max() < max_rel_err
    for got, want in zip(naive_grads, attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **options)):
        assert 0 < np.abs(got - want).max() / np.abs(want).max() < max_rel_err


@pytest.mark.parametrize("cu_q,cu_k,match", [
    ([1, 3], [0, 4], "cu_seqlens_q"),
    ([0, 3], [0, 5], "cu_seqlens_k"),
    ([0, 2, 1, 3], [0, 1, 2, 4], "cu_seqlens_q"),
    ([0], [0], "cu_seqlens_q"),
    ([0, 3], [0, 1, 4], "cu_seqlens_q and cu_seqlens_k"),
])
def test_varlen_bad_cu_seqlens(cu_q, cu_k, match):
    q, k, v, _, _ = random_varlen([3], [4], 2, 2, 8)
    with pytest.raises(ValueError, match=match):
        attention_varlen(q, k, v, np.array(cu_q, np.int32), np.array(cu_k, np.int32))


def test_varlen_bad_shapes():
    q, k, v, cu_q, cu_k = random_varlen([3, 2], [4, 1], 2, 2, 8)
    with pytest.raises(ValueError, match=r"\bq\b"):
        attention_varlen(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match=r"\bv\b"):
        attention_varlen(q, k, v[:, :1], cu_q, cu_k)
    with pytest.raises(ValueError, match="dout"):
        attention_varlen_backward(q[:4], q, k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_varlen(q, k, v, cu_q, cu_k, dropout_mask=np.ones((2, 2, 2, 4), bool), dropout_p=0.1)
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=np.ones((3, 2), np.float32))


@pytest.mark.parametrize("causal,window_size,apart", [
    (False, (-1, -1), False), (True, (-1, -1), True), (False, (5, -1), True), (False, (-1, 0), True),
    (False, (100, -1), False), (False, (100, 100), False), (True, (100, -1), True),
])
def test_queries_rotate_apart(causal, window_size, apart):
    """flash-attn's flash_attn_with_kvcache: q rows take positions cache_seqlens + i where the step is
    causal or local (a window bound below the cache's capacity, here 100), else all cache_seqlens."""
    assert queries_rotate_apart(causal, window_size, 100) is apart


@pytest.mark.parametrize("apart", [False, True])
def test_kvcache_sequences_rotary_positions(apart):
    rng = np.random.default_rng(3)
    row = rng.standard_normal((1, 2, 16))
    q = np.repeat(row, 3, axis=0)[None].astype(np.float16)  # three equal query rows
    k_cache = rng.standard_normal((1, 40, 1, 16)).astype(np.float16)
    k_new = rng.standard_normal((1, 3, 1, 16)).astype(np.float16)
    angles = rng.uniform(0, 2 * np.pi, (40, 8))
    cos, sin = np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)
    _, _, [(qb, _, _, _)] = kvcache_sequences(q, k_cache, k_cache, k_new, k_new, cache_seqlens=np.array([7]),
                                             rotary_cos=cos, rotary_sin=sin, rotate_apart=apart)
    at_seven = apply_rotary(q[0, :1].astype(np.float64), cos, sin, np.array([7])).astype(np.float16)
    np.testing.assert_array_equal(qb[0], at_seven[0].astype(np.float64))
    assert np.array_equal(qb[1], qb[0]) is not apart


def test_from_top_left_is_jax_nns_mask():
    """score_mods.from_top_left's keys and window give, over cuflash's bottom-right diagonal, the mask
    jax.nn.dot_product_attention defines (key j <= i under causal, i - left <= j <= i + right under a
    window), and raise exactly where that mask leaves a query without a key."""
    import itertools

    from cuflash import reference, score_mods
    from tests.numerics import jax_nn_mask

    windows = [None, (0, 0), (3, 0), (0, 3), (4, 7), (100, 100), (1, 50)]
    for nq, nk, causal, window in itertools.product([1, 2, 5, 17, 64], [1, 3, 5, 17, 64, 100], (False, True),
                                                     windows):
        want = jax_nn_mask(nq, nk, causal, window)
        try:
            keys, window_size = score_mods.from_top_left(nq, nk, causal, window)
        except NotImplementedError:
            assert not want.any(axis=1).all(), (nq, nk, causal, window)
            continue
        got = np.zeros((nq, nk), bool)
        got[:, :keys] = reference.visible_mask(nq, keys, window_size=window_size)
        assert (got == want).all(), (nq, nk, causal, window)


def test_top_left_alignment():
    """Top-left masks: causal over more keys than queries sees none past the queries (so it is the
    bottom-right mask of the first nq keys); a window's and ALiBi's diagonal is i itself."""
    rng = np.random.default_rng(41)
    q, k, v = (rng.standard_normal((1, n, 2, 16)) for n in (5, 9, 9))
    top_left = attention(q, k, v, causal=True, mask_alignment="top_left")
    np.testing.assert_allclose(top_left, attention(q, k[:, :5], v[:, :5], causal=True), atol=1e-12)
    slopes = np.array([0.5, 0.25])
    got = attention(q, k, v, window_size=(2, 1), alibi_slopes=slopes, mask_alignment="top_left")
    i, j = np.arange(5)[:, None], np.arange(9)[None, :]
    for h in range(2):
        s = q[0, :, h] @ k[0, :, h].T / 4.0 - slopes[h] * np.abs(i - j)
        s = np.where((j >= i - 2) & (j <= i + 1), s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(got[0, :, h], (p / p.sum(axis=1, keepdims=True)) @ v[0, :, h], atol=1e-12)
    with pytest.raises(ValueError, match="mask_alignment"):
        attention(q, k, v, mask_alignment="top-left")


def test_varlen_seqused_is_the_packed_batch_of_used_rows():
    rng = np.random.default_rng(42)
    cu_q, cu_k = np.array([0, 6, 6, 15]), np.array([0, 4, 9, 20])
    used_q, used_k = np.array([3, 0, 9]), np.array([4, 2, 7])
    q, k, v = rng.standard_normal((15, 2, 8)), rng.standard_normal((20, 1, 8)), rng.standard_normal((20, 1, 8))
    dout = rng.standard_normal(q.shape)
    rows_q = np.concatenate([np.arange(cu_q[b], cu_q[b] + used_q[b]) for b in range(3)])
    rows_k = np.concatenate([np.arange(cu_k[b], cu_k[b] + used_k[b]) for b in range(3)])
    packed_cu_q, packed_cu_k = np.concatenate([[0], np.cumsum(used_q)]), np.concatenate([[0], np.cumsum(used_k)])
    for alignment in ("bottom_right", "top_left"):
        kw = dict(causal=True, mask_alignment=alignment)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, return_lse=True, **kw)
        ref, ref_lse = attention_varlen(q[rows_q], k[rows_k], v[rows_k], packed_cu_q, packed_cu_k, return_lse=True,
                                        **kw)
        np.testing.assert_array_equal(out[rows_q], ref)
        np.testing.assert_array_equal(lse[:, rows_q], ref_lse)
        unused = np.setdiff1d(np.arange(15), rows_q)
        assert np.all(out[unused] == 0) and np.all(np.isneginf(lse[:, unused]))
        grads = attention_varlen_backward(dout, q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, **kw)
        refs = attention_varlen_backward(dout[rows_q], q[rows_q], k[rows_k], v[rows_k], packed_cu_q, packed_cu_k,
                                         **kw)
        for grad, grad_ref, rows in zip(grads, refs, (rows_q, rows_k, rows_k)):
            np.testing.assert_array_equal(grad[rows], grad_ref)
            assert np.all(np.delete(grad, rows, axis=0) == 0)
    with pytest.raises(ValueError, match="seqused_k"):
        attention_varlen(q, k, v, cu_q, cu_k, seqused_k=np.array([5, 2, 7]))
