"""Dropout: cuflash.attention, attention_backward and the varlen entry points with dropout_p, against
cuflash.reference given the keep mask that cuflash.reference.dropout_keep_mask draws (the kernels'
Philox stream, regenerated in the backward), the keep rate, and bitwise reproducibility."""

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import reference
from tests.numerics import ATOL, DTYPES, assert_close_2x, check_lse, mentions, randn

pytestmark = pytest.mark.gpu

CASES = {
    "awkward": dict(batch=2, nq=97, nk=257, nheads=4, nheads_kv=2, headdim=64),
    "causal_gqa": dict(batch=1, nq=257, nk=130, nheads=8, nheads_kv=2, headdim=128, causal=True),
    "window_softcap": dict(batch=2, nq=17, nk=300, nheads=2, nheads_kv=1, headdim=96, window_size=(40, 8),
                           softcap=5.0),
    "one_row": dict(batch=3, nq=1, nk=1025, nheads=2, nheads_kv=2, headdim=128),
    "sm80_headdim_32": dict(batch=2, nq=65, nk=130, nheads=4, nheads_kv=2, headdim=32, causal=True),
    # the Hopper backward of head dim 256 (200 zero-padded): keys split between its consumers
    "headdim_200_softcap": dict(batch=1, nq=130, nk=97, nheads=4, nheads_kv=2, headdim=200, causal=True,
                                softcap=5.0),
    # head dim 192's: consumer 0 computes dV, consumer 1 dK (160 zero-padded)
    "headdim_160_window": dict(batch=2, nq=97, nk=130, nheads=4, nheads_kv=1, headdim=160, window_size=(30, 50)),
}


def _grads_close(grads, refs, naives, dtype):
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(g.get(), r, n, ATOL[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_the_reference_given_the_mask(dtype, name):
    case = dict(CASES[name])
    batch, nq, nk, nheads, nheads_kv, headdim = (case.pop(x) for x in
                                                 ("batch", "nq", "nk", "nheads", "nheads_kv", "headdim"))
    rng = np.random.default_rng(len(name))
    q, k, v = (randn(rng, (batch, n, h, headdim), dtype) for n, h in ((nq, nheads), (nk, nheads_kv), (nk, nheads_kv)))
    dout = randn(rng, (batch, nq, nheads, headdim), dtype)
    p, seed, offset = 0.17, 1234 + len(name), 99
    mask = reference.dropout_keep_mask(seed, offset, batch, nheads, nq, nk, p)
    drop = dict(dropout_mask=mask, dropout_p=p)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **case, **drop)
    naive = reference.attention_naive_lowp(q, k, v, dtype=dtype, **case, **drop)
    dq_, dk_, dv_ = (cupy.asarray(x) for x in (q, k, v))
    options = dict(case, dropout_p=p, seed=seed, offset=offset)
    out = cupy.full(q.shape, np.nan, dtype)
    _, lse = cuflash.attention(dq_, dk_, dv_, out=out, return_lse=True, **options)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(dtype)])
    check_lse(lse, ref_lse)

    refs = reference.attention_backward(dout, q, k, v, **case, **drop)
    naives = reference.attention_backward_naive_lowp(dout, q, k, v, dtype=dtype, **case, **drop)
    for deterministic in (False, True):
        grads = cuflash.attention_backward(cupy.asarray(dout), dq_, dk_, dv_, out, lse, deterministic=deterministic,
                                           **options)
        _grads_close(grads, refs, naives, dtype)


def test_keep_rate_and_reproducibility():
    """Over 8M draws the keep rate is within 4 sigma of 1 - p; the same (seed, offset) gives the same
    bits, another seed or offset another output."""
    rng = np.random.default_rng(5)
    batch, nheads, n, headdim = 2, 8, 1024, 64
    q, k = (cupy.asarray(randn(rng, (batch, n, nheads, headdim), np.float16)) for _ in range(2))
    v = cupy.ones((batch, n, nheads, headdim), np.float16)
    p = 0.1
    # With v = 1 and softmax_scale tiny, P = 1/n and out = (kept keys in the row) / (n (1 - p)).
    out = cuflash.attention(q, k, v, softmax_scale=1e-6, dropout_p=p, seed=7, offset=3)
    kept = out[..., 0].astype(cupy.float64) * n * (1 - p)
    rate = float(kept.mean()) / n
    sigma = np.sqrt(p * (1 - p) / (batch * nheads * n * n))
    assert abs(rate - (1 - p)) < 4 * sigma + 1 / 2048, (rate, sigma)  # + the fp16 rounding of out
    mask = reference.dropout_keep_mask(7, 3, 1, 1, 64, n, p)  # the host stream agrees on a slice
    np.testing.assert_allclose(kept[0, :64, 0].get(), mask[0, 0].sum(axis=1), atol=0.6)

    again = cuflash.attention(q, k, v, softmax_scale=1e-6, dropout_p=p, seed=7, offset=3)
    assert bool((again == out).all())
    for seed, offset in ((8, 3), (7, 4)):
        other = cuflash.attention(q, k, v, softmax_scale=1e-6, dropout_p=p, seed=seed, offset=offset)
        assert not bool((other == out).all())


def test_varlen_causal_dropout():
    rng = np.random.default_rng(9)
    lengths_q, lengths_k = [17, 0, 130, 64], [40, 5, 129, 64]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q, k, v = (randn(rng, (sum(n), h, 64), np.float16) for n, h in ((lengths_q, 4), (lengths_k, 2), (lengths_k, 2)))
    dout = randn(rng, q.shape, np.float16)
    p, seed, offset = 0.3, 11, 2**40 + 5
    mask = reference.dropout_keep_mask(seed, offset, len(lengths_q), 4, max(lengths_q), max(lengths_k), p)
    drop = dict(dropout_mask=mask, dropout_p=p, causal=True)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **drop)
    naive = reference.attention_varlen_naive_lowp(q, k, v, cu_q, cu_k, dtype=np.float16, **drop)
    dev = [cupy.asarray(x) for x in (q, k, v)]
    options = dict(causal=True, dropout_p=p, seed=seed, offset=offset)
    lengths = (max(lengths_q), max(lengths_k))
    out, lse = cuflash.attention_varlen(*dev, cu_q, cu_k, *lengths, return_lse=True, **options)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])
    check_lse(lse, ref_lse)
    grads = cuflash.attention_varlen_backward(cupy.asarray(dout), *dev, out, lse, cu_q, cu_k, *lengths, **options)
    refs = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **drop)
    naives = reference.attention_varlen_backward_naive_lowp(dout, q, k, v, cu_q, cu_k, dtype=np.float16, **drop)
    _grads_close(grads, refs, naives, np.float16)


@pytest.mark.parametrize("sizes, seed, offset, p", [((1, 1, 1, 1), 0, 0, 0.5),
                                                   ((2, 3, 17, 97), 2**63 + 9, 2**40 + 5, 0.17),
                                                   ((1, 2, 257, 31), 12345, 7, 0.9)])
def test_device_keep_mask_is_the_hosts(sizes, seed, offset, p):
    """cuflash.dropout_keep_mask (the kernels' own functions on the device) equals
    reference.dropout_keep_mask bit for bit, at awkward sizes and with the seed's and offset's high words."""
    keep = cuflash.dropout_keep_mask(seed, offset, *sizes, p)
    assert keep.dtype == np.bool_ and keep.shape == sizes
    np.testing.assert_array_equal(keep.get(), reference.dropout_keep_mask(seed, offset, *sizes, p))


@pytest.mark.parametrize("args, error, name", [((1, 0, 1, 1, 1, 1, 0.0), ValueError, "dropout_p"),
                                               ((1, 0, 1, 1, 1, 1, 1.0), ValueError, "dropout_p"),
                                               ((-1, 0, 1, 1, 1, 1, 0.5), ValueError, "seed"),
                                               ((1, 0, 1, -2, 1, 1, 0.5), ValueError, "nheads"),
                                               ((1, 0, 1, 1, 2.5, 1, 0.5), ValueError, "seqlen_q")])
def test_device_keep_mask_names_bad_arguments(args, error, name):
    with pytest.raises(error, match=name):
        cuflash.dropout_keep_mask(*args)


def test_vjp_regenerates_the_mask():
    rng = np.random.default_rng(12)
    q, k, v = (cupy.asarray(randn(rng, (1, 70, 2, 64), np.float16)) for _ in range(3))
    dout = cupy.asarray(randn(rng, (1, 70, 2, 64), np.float16))
    options = dict(causal=True, dropout_p=0.25, seed=3, offset=0)
    out, vjp = cuflash.attention_vjp(q, k, v, **options)
    out2, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert bool((out == out2).all())
    for a, b in zip(vjp(dout, deterministic=True),
                    cuflash.attention_backward(dout, q, k, v, out2, lse, deterministic=True, **options)):
        assert bool((a == b).all())


@pytest.mark.parametrize("p, error", [(1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError)])
def test_bad_dropout_p(p, error):
    q = cupy.zeros((1, 16, 2, 64), np.float16)
    with pytest.raises(error, match=mentions("dropout_p")):
        cuflash.attention(q, q, q, dropout_p=p)


def _seed_words(seed, offset):
    """The device words that stand for (seed, offset): seed low, seed high, offset low, offset high."""
    return cupy.asarray([seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32], np.uint32)


@pytest.mark.parametrize("headdim", [32, 64, 128])  # 32: the sm_80 kernels on Hopper
def test_seed_words_on_the_device_give_the_host_seeds_mask(headdim):
    """seed as a device array of 4 words: forward and both backward modes equal, bitwise, the calls
    with the same seed and offset as ints; packed batches too."""
    rng = np.random.default_rng(headdim)
    q, k, v = (cupy.asarray(randn(rng, (2, n, h, headdim), np.float16)) for n, h in ((97, 4), (130, 2), (130, 2)))
    dout = cupy.asarray(randn(rng, (2, 97, 4, headdim), np.float16))
    seed, offset = 2**40 + 17, 2**33 + 5
    host = dict(causal=True, dropout_p=0.25, seed=seed, offset=offset)
    device = dict(causal=True, dropout_p=0.25, seed=_seed_words(seed, offset))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **host)
    out_d, lse_d = cuflash.attention(q, k, v, return_lse=True, **device)
    assert bool((out == out_d).all()) and bool((lse == lse_d).all())
    for deterministic in (False, True):
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **host)
        dq_d, dk_d, dv_d = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **device)
        assert bool((dk == dk_d).all()) and bool((dv == dv_d).all())
        if deterministic:  # the atomic dQ adds in any order
            assert bool((dq == dq_d).all())
        else:
            cupy.testing.assert_allclose(dq_d, dq, rtol=1e-2, atol=1e-3)
    cu = np.array([0, 40, 97], np.int32)
    packed = [x.reshape(-1, *x.shape[2:])[:97] for x in (q, k, v)]
    varlen_host = cuflash.attention_varlen(*packed, cu, cu, 57, 57, **host)
    varlen_device = cuflash.attention_varlen(*packed, cu, cu, 57, 57, **device)
    assert bool((varlen_host == varlen_device).all())


def test_graph_replays_follow_new_seed_words():
    """A captured forward and backward with their seed on the device: each replay after new words are
    written equals the eager calls with those words (the backward's deterministic dq bitwise too)."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (cupy.asarray(randn(rng, (1, 130, 2, 64), np.float16)) for _ in range(4))
    words = _seed_words(1, 2)
    out = cupy.empty_like(q)
    lse = cupy.empty((1, 2, 130), np.float32)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    workspace = cuflash.backward_workspace(q, k, v, dropout_p=0.3, deterministic=True)
    drop = dict(dropout_p=0.3, seed=words)

    def step():
        cuflash.attention(q, k, v, out=out, lse=lse, **drop)
        cuflash.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                   workspace=workspace, deterministic=True, **drop)

    cupy.cuda.Device().synchronize()  # the inputs were made on the null stream, which `stream` does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # first calls: compiled, outside the capture
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for seed, offset in ((5, 0), (5, 1), (2**50, 3)):
            words[...] = _seed_words(seed, offset)  # on the stream, before the replay
            graph.launch(stream)
            options = dict(dropout_p=0.3, seed=seed, offset=offset)
            expected, expected_lse = cuflash.attention(q, k, v, return_lse=True, **options)
            assert bool((out == expected).all())
            expected_grads = cuflash.attention_backward(dout, q, k, v, expected, expected_lse, deterministic=True,
                                                        **options)
            assert all(bool((g == e).all()) for g, e in zip(grads, expected_grads))


@pytest.mark.parametrize("words, error", [
    (lambda: cupy.zeros(3, np.uint32), "4 contiguous uint32"), (lambda: cupy.zeros(4, np.int32), "4 contiguous uint32"),
    (lambda: cupy.zeros(8, np.uint32)[::2], "4 contiguous uint32"), (lambda: cupy.zeros(5, np.uint32)[1:], "aligned")],
    ids=["three_words", "int32", "strided", "misaligned"])
def test_bad_seed_words(words, error):
    words = words()
    q = cupy.zeros((1, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match=error):
        cuflash.attention(q, q, q, dropout_p=0.1, seed=words)
    with pytest.raises(ValueError, match="offset"):
        cuflash.attention(q, q, q, dropout_p=0.1, seed=_seed_words(1, 0), offset=3)
