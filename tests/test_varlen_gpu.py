"""Packed batches of different lengths: cuflash.attention_varlen, attention_varlen_backward and
attention_varlen_vjp against cuflash.reference's varlen functions with the 2x rule.

Both kernel families run every accuracy case (the `kernel` fixture). Lengths
mix empty sequences, single rows, awkward lengths and Nq != Nk per sequence;
outputs start poisoned, so a row the kernels leave unwritten shows.
"""

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference
from tests.numerics import check_lse, ATOL, DTYPES, assert_close_2x, mentions, randn

pytestmark = pytest.mark.gpu

# (query lengths, key lengths) per sequence.
LENGTHS = {
    "awkward": ([17, 1, 257, 0, 97, 1025], [17, 1, 257, 0, 97, 1025]),
    "q_ne_k": ([97, 300, 1, 64, 0], [300, 97, 65, 0, 17]),
    "one": ([129], [1000]),
    "many_short": ([1, 3, 7, 2, 16, 9, 31, 5, 128, 4] * 3, [2, 3, 70, 1, 16, 9, 40, 5, 130, 4] * 3),
}
OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(32, 8)),
    "window_causal": dict(window_size=(48, -1), causal=True),
    "softcap_alibi": dict(softcap=4.0, alibi=True),
    "all_causal": dict(window_size=(64, -1), causal=True, softcap=3.0, alibi=True),
}
POISON = 1e4


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, dtype, lengths_q, lengths_k, nheads, nheads_kv, headdim, with_dout=False):
    """Host arrays (dout?, q, k, v) of a packed batch, their device copies, and the offsets."""
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    host = [randn(rng, (total_q, nheads, headdim), dtype)] if with_dout else []
    host += [randn(rng, (total_q, nheads, headdim), dtype), randn(rng, (total_k, nheads_kv, headdim), dtype),
             randn(rng, (total_k, nheads_kv, headdim), dtype)]
    return host, [cupy.asarray(x) for x in host], offsets(lengths_q), offsets(lengths_k)


def materialise(name, rng, batch, nheads):
    """(host kwargs, device kwargs) of the named options, with (batch, nheads) ALiBi slopes where asked."""
    options = dict(OPTIONS[name])
    if not options.pop("alibi", False):
        return options, options
    slopes = rng.uniform(0.01, 0.3, (batch, nheads)).astype(np.float32)
    return {**options, "alibi_slopes": slopes}, {**options, "alibi_slopes": cupy.asarray(slopes)}



def run_forward(dev, cu_q, cu_k, lengths_q, lengths_k, dev_kw, device_offsets=False):
    q = dev[-3]
    out = cupy.full(q.shape, POISON, q.dtype)
    lse = cupy.full((q.shape[1], q.shape[0]), POISON, cupy.float32)
    cu = (cupy.asarray(cu_q), cupy.asarray(cu_k)) if device_offsets else (cu_q, cu_k)
    result = cuflash.attention_varlen(*dev[-3:], *cu, max(lengths_q), max(lengths_k), return_lse=True, out=out,
                                      lse=lse, **dev_kw)
    assert result[0] is out and result[1] is lse
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_forward(kernel, rng, dtype, name, lengths):
    lengths_q, lengths_k = LENGTHS[lengths]
    host, dev, cu_q, cu_k = packed(rng, dtype, lengths_q, lengths_k, 4, 2, 128)
    host_kw, dev_kw = materialise(name, rng, len(lengths_q), 4)
    out, lse = run_forward(dev, cu_q, cu_k, lengths_q, lengths_k, dev_kw, device_offsets=name == "plain")
    ref, ref_lse = reference.attention_varlen(*host, cu_q, cu_k, return_lse=True, **host_kw)
    naive = reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, dtype=dtype, **host_kw)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(dtype)])
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("headdim", [32, 64, 96, 192, 256])
@pytest.mark.parametrize("name", ["plain", "window_causal"])
def test_forward_headdims(kernel, rng, headdim, name):
    lengths_q, lengths_k = LENGTHS["q_ne_k"]
    host, dev, cu_q, cu_k = packed(rng, ml_dtypes.bfloat16, lengths_q, lengths_k, 2, 1, headdim)
    host_kw, dev_kw = materialise(name, rng, len(lengths_q), 2)
    out, lse = run_forward(dev, cu_q, cu_k, lengths_q, lengths_k, dev_kw)
    ref, ref_lse = reference.attention_varlen(*host, cu_q, cu_k, return_lse=True, **host_kw)
    naive = reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, dtype=host[0].dtype, **host_kw)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(ml_dtypes.bfloat16)])
    check_lse(lse, ref_lse)


def test_forward_equals_attention_per_sequence(kernel, rng):
    """A packed batch of one sequence length gives attention's result on the (batch, seqlen) layout."""
    batch, n, nheads, headdim = 3, 200, 4, 64
    q, k, v = (cupy.asarray(randn(rng, (batch, n, nheads, headdim), np.float16)) for _ in range(3))
    cu = offsets([n] * batch)
    out, lse = cuflash.attention_varlen(*(x.reshape(batch * n, nheads, headdim) for x in (q, k, v)), cu, cu, n, n,
                                        causal=True, return_lse=True)
    ref_out, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    host_ref = reference.attention(q.get(), k.get(), v.get(), causal=True)
    naive = reference.attention_naive_lowp(q.get(), k.get(), v.get(), causal=True, dtype=np.float16)
    assert_close_2x(out.get().reshape(batch, n, nheads, headdim), host_ref, naive, ATOL[np.dtype(np.float16)])
    np.testing.assert_allclose(lse.get().reshape(nheads, batch, n).transpose(1, 0, 2), ref_lse.get(), atol=1e-4)
    np.testing.assert_allclose(out.get().reshape(batch, n, nheads, headdim).astype(np.float32),
                               ref_out.get().astype(np.float32), atol=2e-3)


def test_forward_strided_views(kernel, rng):
    """q the second half of a wider head dim, k and v interleaved in one array."""
    lengths_q, lengths_k = [33, 0, 130], [70, 5, 129]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    wide = randn(rng, (sum(lengths_q), 4, 128), np.float16)
    kv = randn(rng, (sum(lengths_k), 2, 2, 64), np.float16)
    host = (wide[:, :, 64:], kv[:, 0], kv[:, 1])
    dev_wide, dev_kv = cupy.asarray(wide), cupy.asarray(kv)
    dev = (dev_wide[:, :, 64:], dev_kv[:, 0], dev_kv[:, 1])
    out, lse = run_forward(dev, cu_q, cu_k, lengths_q, lengths_k, dict(causal=True))
    ref, ref_lse = reference.attention_varlen(*host, cu_q, cu_k, causal=True, return_lse=True)
    naive = reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, causal=True, dtype=np.float16)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])
    check_lse(lse, ref_lse)


# --- Backward ---------------------------------------------------------------


def check_backward(rng, dtype, lengths, name, deterministic, headdim=128):
    lengths_q, lengths_k = LENGTHS[lengths]
    host, dev, cu_q, cu_k = packed(rng, dtype, lengths_q, lengths_k, 4, 2, headdim, with_dout=True)
    host_kw, dev_kw = materialise(name, rng, len(lengths_q), 4)
    longest = (max(lengths_q), max(lengths_k))
    out, lse = cuflash.attention_varlen(*dev[1:], cu_q, cu_k, *longest, return_lse=True, **dev_kw)
    grads = [cupy.full(x.shape, POISON, x.dtype) for x in dev[1:]]
    result = cuflash.attention_varlen_backward(dev[0], *dev[1:], out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                               *longest, deterministic=deterministic, dq=grads[0], dk=grads[1],
                                               dv=grads[2], **dev_kw)
    assert all(g is r for g, r in zip(grads, result))
    refs = reference.attention_varlen_backward(*host, cu_q, cu_k, **host_kw)
    naives = reference.attention_varlen_backward_naive_lowp(*host, cu_q, cu_k, dtype=dtype, **host_kw)
    for grad, ref, naive in zip(grads, refs, naives):
        assert_close_2x(grad.get(), ref, naive, ATOL[np.dtype(dtype)])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("lengths", ["awkward", "q_ne_k", "many_short"])
def test_backward(kernel, rng, deterministic, dtype, name, lengths):
    check_backward(rng, dtype, lengths, name, deterministic)


@pytest.mark.parametrize("headdim", [64, 96, 192])
@pytest.mark.parametrize("name", ["plain", "window_causal"])
def test_backward_headdims(kernel, rng, headdim, name):
    check_backward(rng, np.float16, "q_ne_k", name, False, headdim)


def test_backward_deterministic_is_bitwise(kernel):
    lengths_q, lengths_k = LENGTHS["awkward"]
    host, dev, cu_q, cu_k = packed(np.random.default_rng(1), np.float16, lengths_q, lengths_k, 4, 2, 128, True)
    runs = []
    for _ in range(2):
        out, vjp = cuflash.attention_varlen_vjp(*dev[1:], cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                                softcap=3.0, window_size=(64, -1))
        runs.append([g.get().view(np.uint16) for g in vjp(dev[0], deterministic=True)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_vjp_matches_reference(kernel, rng):
    lengths_q, lengths_k = LENGTHS["q_ne_k"]
    host, dev, cu_q, cu_k = packed(rng, ml_dtypes.bfloat16, lengths_q, lengths_k, 4, 4, 64, with_dout=True)
    out, vjp = cuflash.attention_varlen_vjp(*dev[1:], cu_q, cu_k, max(lengths_q), max(lengths_k),
                                            window_size=(16, 16))
    ref = reference.attention_varlen(*host[1:], cu_q, cu_k, window_size=(16, 16))
    naive = reference.attention_varlen_naive_lowp(*host[1:], cu_q, cu_k, window_size=(16, 16),
                                                  dtype=ml_dtypes.bfloat16)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(ml_dtypes.bfloat16)])
    refs = reference.attention_varlen_backward(*host, cu_q, cu_k, window_size=(16, 16))
    naives = reference.attention_varlen_backward_naive_lowp(*host, cu_q, cu_k, window_size=(16, 16),
                                                            dtype=ml_dtypes.bfloat16)
    for grad, r, n in zip(vjp(dev[0]), refs, naives):
        assert_close_2x(grad.get(), r, n, ATOL[np.dtype(ml_dtypes.bfloat16)])


# --- Bad input --------------------------------------------------------------


def test_bad_offsets_name_the_argument(rng):
    host, dev, cu_q, cu_k = packed(rng, np.float16, [5, 7], [5, 7], 2, 2, 64)
    q, k, v = dev
    cases = [
        (dict(cu_seqlens_q=cu_q[:-1]), "cu_seqlens_q"),  # ends short of total_q
        (dict(cu_seqlens_q=cu_q.astype(np.int64)), "cu_seqlens_q"),
        (dict(cu_seqlens_k=np.array([0, 7, 5], np.int32)), "cu_seqlens_k"),  # decreasing
        (dict(cu_seqlens_k=offsets([5, 7, 0])), "cu_seqlens_k"),  # another batch size
        (dict(max_seqlen_q=6), "max_seqlen_q"),  # shorter than a sequence
        (dict(max_seqlen_k=0), "max_seqlen_k"),
    ]
    for change, name in cases:
        args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=mentions(name)):
            cuflash.attention_varlen(q, k, v, **args)
    with pytest.raises(ValueError, match=mentions("q")):
        cuflash.attention_varlen(q[None], k, v, cu_q, cu_k, 7, 7)
    with pytest.raises(ValueError, match=mentions("alibi_slopes")):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, alibi_slopes=cupy.ones((3, 2), cupy.float32))
    with pytest.raises(ValueError, match=mentions("lse")):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, lse=cupy.empty((12, 2), cupy.float32))


def test_device_offsets_out_of_range_stay_in_bounds(rng):
    """Wrong device offsets (the caller's contract) give wrong results but touch nothing outside
    q, k, v and out: the rows around out are guard rows that must keep their poison."""
    lengths = [40, 60]
    host, dev, cu_q, cu_k = packed(rng, np.float16, lengths, lengths, 2, 2, 64)
    guarded = cupy.full((sum(lengths) + 256, 2, 64), POISON, cupy.float16)
    out = guarded[128:-128]
    bad = cupy.asarray(np.array([-500, 30, 10_000], np.int32))
    cuflash.attention_varlen(*dev, bad, bad, 100, 100, out=out)
    guard = cupy.concatenate([guarded[:128], guarded[-128:]]).get()
    assert np.all(guard == np.float16(POISON))


def test_repeated_calls_read_the_offsets_each_time(kernel, rng):
    """A repeated call (a launch plan) with new offset values in the same device arrays follows them."""
    total, nheads, headdim = 300, 2, 64
    host, dev, _, _ = packed(rng, np.float16, [total], [total], nheads, nheads, headdim, with_dout=True)
    cu = cupy.zeros(3, cupy.int32)
    for lengths in ([100, 200], [299, 1], [0, 300]):
        cu.set(offsets(lengths))
        out, lse = cuflash.attention_varlen(*dev[1:], cu, cu, 300, 300, causal=True, return_lse=True)
        grads = cuflash.attention_varlen_backward(dev[0], *dev[1:], out, lse, cu, cu, 300, 300, causal=True)
        ref = reference.attention_varlen(*host[1:], offsets(lengths), offsets(lengths), causal=True)
        naive = reference.attention_varlen_naive_lowp(*host[1:], offsets(lengths), offsets(lengths), causal=True,
                                                      dtype=np.float16)
        assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])
        refs = reference.attention_varlen_backward(*host, offsets(lengths), offsets(lengths), causal=True)
        naives = reference.attention_varlen_backward_naive_lowp(*host, offsets(lengths), offsets(lengths),
                                                                causal=True, dtype=np.float16)
        for grad, r, n in zip(grads, refs, naives):
            assert_close_2x(grad.get(), r, n, ATOL[np.dtype(np.float16)])
    assert len(cuflash.varlen._fwd_plans) == 1 and len(cuflash.varlen._bwd_plans) == 1


@pytest.mark.hopper
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window_size=(40, 8), softcap=3.0)])
@pytest.mark.parametrize("lengths", ["awkward", "q_ne_k"])
def test_fp8_forward(rng, options, lengths):
    """fp8 e4m3 packed batches (the V transpose per sequence) against the float64 reference of the
    dequantised inputs, with the 2x rule against the naive fp8 computation, sequence by sequence."""
    lengths_q, lengths_k = LENGTHS[lengths]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    nheads, nheads_kv, headdim, batch = 4, 2, 128, len(lengths_q)
    qf = rng.standard_normal((1, sum(lengths_q), nheads_kv, nheads // nheads_kv * headdim))
    q_bits, q_scale = reference.fp8_quantize(qf)  # q's descale is per kv head: its heads in groups
    (k_bits, k_scale), (v_bits, v_scale) = (reference.fp8_quantize(rng.standard_normal((1, sum(lengths_k), nheads_kv,
                                                                                          headdim))) for _ in range(2))
    values = [reference.fp8_dequantize(q_bits, q_scale).reshape(-1, nheads, headdim)]
    values += [reference.fp8_dequantize(b, s)[0] for b, s in ((k_bits, k_scale), (v_bits, v_scale))]
    bits = (q_bits.reshape(-1, nheads, headdim), k_bits[0], v_bits[0])
    scales = [cupy.asarray(np.repeat(s.reshape(1, nheads_kv), batch, 0).astype(np.float32))
              for s in (q_scale, k_scale, v_scale)]
    out = cupy.full(bits[0].shape, np.nan, dtype=ml_dtypes.bfloat16)
    got, lse = cuflash.attention_varlen(*(cupy.asarray(b) for b in bits), cupy.asarray(cu_q), cupy.asarray(cu_k),
                                        max(lengths_q), max(lengths_k), out=out, return_lse=True,
                                        q_descale=scales[0], k_descale=scales[1], v_descale=scales[2], **options)
    assert got is out
    ref, ref_lse = reference.attention_varlen(*values, cu_q, cu_k, return_lse=True, **options)
    naive = np.zeros_like(ref)
    for b in range(batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:  # else 0, as the reference
            naive[rows_q] = reference.attention_naive_fp8(values[0][None, rows_q], values[1][None, rows_k],
                                                          values[2][None, rows_k], **options)[0]
    assert_close_2x(got.get().astype(np.float64), ref, naive, 1e-2)
    check_lse(lse, ref_lse)


@pytest.mark.hopper
def test_fp8_max_seqlen_past_the_packed_keys(rng):
    """A max_seqlen_k far above the packed keys (valid up to 2^31) gives the result of the true one:
    the V transpose's grid follows the packed keys (at 2^24 keys its y dim overflowed)."""
    lengths = [17, 40]
    cu = cupy.asarray(offsets(lengths))
    codes = [cupy.asarray(rng.integers(0, 120, (sum(lengths), 2, 128), dtype=np.uint8)) for _ in range(3)]
    want = cuflash.attention_varlen(*codes, cu, cu, 40, 40)
    got = cuflash.attention_varlen(*codes, cu, cu, 40, 2**24)
    assert bool((got.view(np.uint16) == want.view(np.uint16)).all())


# --- seqused and mask_alignment --------------------------------------------
# Spans of a padded batch and the rows each sequence uses of them (empty, whole and partial uses;
# Nq != Nk). The unused rows of q, k and v hold UNUSED, far from the data: a kernel that read one
# would be far off.
SPANS = ([40, 1, 300, 7, 97, 130], [60, 17, 257, 5, 97, 129])
USED = ([17, 1, 257, 0, 50, 129], [60, 0, 200, 5, 1, 129])
UNUSED = 30.0
ALIGNED_OPTIONS = ["plain", "causal", "window", "window_causal", "softcap_alibi", "all_causal"]


def padded(rng, dtype, nheads, nheads_kv, headdim, with_dout=False):
    """packed()'s arrays over SPANS with UNUSED past USED rows; (host, device, cu_q, cu_k, used_q, used_k)."""
    host, _, cu_q, cu_k = packed(rng, dtype, *SPANS, nheads, nheads_kv, headdim, with_dout)
    used_q, used_k = (np.array(u, np.int32) for u in USED)
    arrays = list(zip(host, ["q"] * (len(host) - 2) + ["k", "k"]))
    for x, side in arrays:
        cu, used = (cu_q, used_q) if side == "q" else (cu_k, used_k)
        for b in range(len(used)):
            x[cu[b] + used[b]: cu[b + 1]] = UNUSED
    return host, [cupy.asarray(x) for x in host], cu_q, cu_k, used_q, used_k


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("name", ALIGNED_OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqused_forward(kernel, rng, dtype, name, alignment):
    host, dev, cu_q, cu_k, used_q, used_k = padded(rng, dtype, 4, 2, 128)
    host_kw, dev_kw = materialise(name, rng, len(used_q), 4)
    extra = dict(seqused_q=used_q, seqused_k=used_k, mask_alignment=alignment)
    device_arrays = name == "plain"  # host arrays (checked, copied) elsewhere
    used = (cupy.asarray(used_q), cupy.asarray(used_k)) if device_arrays else (used_q, used_k)
    out, lse = cuflash.attention_varlen(*dev, cupy.asarray(cu_q) if device_arrays else cu_q, cu_k, max(USED[0]),
                                        max(USED[1]), return_lse=True, seqused_q=used[0], seqused_k=used[1],
                                        mask_alignment=alignment, **dev_kw)
    ref, ref_lse = reference.attention_varlen(*host, cu_q, cu_k, return_lse=True, **extra, **host_kw)
    naive = reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, dtype=dtype, **extra, **host_kw)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(dtype)])  # unused rows: 0 in both
    check_lse(lse, ref_lse)  # unused rows: -inf in both


def test_seqused_leaves_given_outputs_unused_rows(kernel, rng):
    """Rows past seqused_q in given out and lse keep their contents; the used rows are written."""
    host, dev, cu_q, cu_k, used_q, used_k = padded(rng, np.float16, 2, 2, 64)
    out = cupy.full(dev[0].shape, POISON, cupy.float16)
    lse = cupy.full((2, dev[0].shape[0]), POISON, cupy.float32)
    cuflash.attention_varlen(*dev, cu_q, cu_k, max(USED[0]), max(USED[1]), out=out, lse=lse, causal=True,
                             seqused_q=used_q, seqused_k=used_k)
    ref, ref_lse = reference.attention_varlen(*host, cu_q, cu_k, return_lse=True, causal=True, seqused_q=used_q,
                                              seqused_k=used_k)
    rows = used_rows(cu_q, used_q)
    unused = np.setdiff1d(np.arange(dev[0].shape[0]), rows)
    assert np.all(out.get()[unused] == np.float16(POISON)) and np.all(lse.get()[:, unused] == POISON)
    naive = reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, dtype=np.float16, causal=True,
                                                  seqused_q=used_q, seqused_k=used_k)
    assert_close_2x(out.get()[rows], ref[rows], naive[rows], ATOL[np.dtype(np.float16)])
    np.testing.assert_allclose(lse.get()[:, rows], ref_lse[:, rows], atol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("name", ["plain", "window_causal", "all_causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqused_backward(kernel, rng, dtype, name, alignment, deterministic):
    host, dev, cu_q, cu_k, used_q, used_k = padded(rng, dtype, 4, 2, 128, with_dout=True)
    host_kw, dev_kw = materialise(name, rng, len(used_q), 4)
    extra = dict(seqused_q=used_q, seqused_k=used_k, mask_alignment=alignment)
    out, vjp = cuflash.attention_varlen_vjp(*dev[1:], cupy.asarray(cu_q), cupy.asarray(cu_k), max(USED[0]),
                                            max(USED[1]), **extra, **dev_kw)
    grads = vjp(dev[0], deterministic=deterministic)  # allocated by cuflash: 0 in unused rows
    refs = reference.attention_varlen_backward(*host, cu_q, cu_k, **extra, **host_kw)
    naives = reference.attention_varlen_backward_naive_lowp(*host, cu_q, cu_k, dtype=dtype, **extra, **host_kw)
    for grad, ref, naive in zip(grads, refs, naives):
        assert_close_2x(grad.get(), ref, naive, ATOL[np.dtype(dtype)])


def test_seqused_padded_batch_equals_packed(kernel, rng):
    """A padded batch with seqused gives the packed batch of the used rows, forward and backward."""
    host, dev, cu_q, cu_k, used_q, used_k = padded(rng, np.float16, 2, 1, 64, with_dout=True)
    kw = dict(causal=True)
    out, vjp = cuflash.attention_varlen_vjp(*dev[1:], cu_q, cu_k, max(USED[0]), max(USED[1]), seqused_q=used_q,
                                            seqused_k=used_k, **kw)
    grads = vjp(dev[0])
    rows = [used_rows(cu_q, used_q), used_rows(cu_k, used_k)]
    packed_arrays = [x[rows[0]] for x in dev[:2]] + [x[rows[1]] for x in dev[2:]]
    packed_out, packed_vjp = cuflash.attention_varlen_vjp(*packed_arrays[1:], offsets(USED[0]), offsets(USED[1]),
                                                          max(USED[0]), max(USED[1]), **kw)
    packed_grads = packed_vjp(packed_arrays[0])
    np.testing.assert_array_equal(out.get()[rows[0]], packed_out.get())
    for grad, packed_grad, r in zip(grads, packed_grads, (rows[0], rows[1], rows[1])):
        np.testing.assert_allclose(grad.get()[r].astype(np.float32), packed_grad.get().astype(np.float32),
                                   atol=2e-3, rtol=1e-3)


def test_bad_seqused_names_the_argument(rng):
    host, dev, cu_q, cu_k = packed(rng, np.float16, [5, 7], [5, 7], 2, 2, 64)
    q, k, v = dev
    cases = [
        (dict(seqused_q=np.array([5, 7], np.int64)), "seqused_q", TypeError),
        (dict(seqused_k=np.array([5], np.int32)), "seqused_k", ValueError),  # another batch size
        (dict(seqused_k=np.array([6, 7], np.int32)), "seqused_k", ValueError),  # past its span
        (dict(seqused_q=np.array([-1, 7], np.int32)), "seqused_q", ValueError),
        (dict(seqused_q=cupy.zeros(4, cupy.int32)[::2]), "seqused_q", ValueError),  # strided
        (dict(seqused_q=[5, 7]), "seqused_q", TypeError),
        (dict(seqused_q=np.array([3, 7], np.int32), max_seqlen_q=6), "max_seqlen_q", ValueError),
        (dict(mask_alignment="top-left"), "mask_alignment", ValueError),
    ]
    for change, name, error in cases:
        args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7)
        args.update(change)
        with pytest.raises(error, match=mentions(name)):
            cuflash.attention_varlen(q, k, v, **args)
    # max_seqlen bounds the used lengths, not the spans
    out = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 7, seqused_q=np.array([4, 3], np.int32))
    assert np.all(np.isfinite(out.get()))


def used_rows(cu, used):
    return np.concatenate([np.arange(cu[b], cu[b] + used[b]) for b in range(len(used))])


@pytest.mark.hopper
def test_seqused_fp8_and_dropout_equal_the_packed_used_rows(rng):
    """fp8 (its V transpose over the whole spans) and dropout (its mask over each sequence's own
    positions) with seqused give the packed batch of the used rows: fp8 within bf16 rounding,
    dropout bit for bit (the same mask)."""
    _, dev, cu_q, cu_k, used_q, used_k = padded(rng, np.float16, 4, 2, 128)
    rows_q, rows_k = used_rows(cu_q, used_q), used_rows(cu_k, used_k)
    longest = (max(USED[0]), max(USED[1]))
    packed_cu = (offsets(USED[0]), offsets(USED[1]))
    used = dict(seqused_q=used_q, seqused_k=used_k)
    codes = [cupy.asarray(rng.integers(0, 120, x.shape, dtype=np.uint8)) for x in dev]
    got = cuflash.attention_varlen(*codes, cu_q, cu_k, *longest, causal=True, **used)
    want = cuflash.attention_varlen(codes[0][rows_q], codes[1][rows_k], codes[2][rows_k], *packed_cu, *longest,
                                    causal=True)
    np.testing.assert_allclose(got.get()[rows_q].astype(np.float32), want.get().astype(np.float32), rtol=1e-2,
                               atol=1e-2)
    drop = dict(dropout_p=0.2, seed=7, offset=3, causal=True)
    got = cuflash.attention_varlen(*dev, cu_q, cu_k, *longest, **used, **drop)
    want = cuflash.attention_varlen(dev[0][rows_q], dev[1][rows_k], dev[2][rows_k], *packed_cu, *longest, **drop)
    np.testing.assert_array_equal(got.get()[rows_q], want.get())
