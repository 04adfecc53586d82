"""cuflash.torch: flash-attn's function names as torch custom ops, eager and under
torch.compile(fullgraph=True), against cuflash.reference (2x rule) and each other (bitwise)."""

import numpy as np
import pytest

from cuflash import reference
from tests.numerics import ATOL, assert_close_2x, e4m3_kvcache_step, mentions, paged_prefill_case, randn
from tests.torch_support import half, leaves, torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("torch_cuda")]


def grads_of(fn, tensors, dout):
    out = fn(*tensors)
    return (out, *torch.autograd.grad(out, tensors, dout))


def as_numpy(t):
    return t.detach().float().cpu().numpy()


def assert_follows_reference(results, host, dout_host, **options):
    """out, dq, dk, dv (torch) against reference.attention and attention_backward of the fp16 host
    inputs (2x rule)."""
    atol = ATOL[np.dtype(np.float16)]
    assert_close_2x(as_numpy(results[0]), reference.attention(*host, **options),
                    reference.attention_naive_lowp(*host, dtype=np.float16, **options), atol)
    refs = reference.attention_backward(dout_host, *host, **options)
    naives = reference.attention_backward_naive_lowp(dout_host, *host, dtype=np.float16, **options)
    for g, r, n in zip(results[1:], refs, naives):
        assert_close_2x(as_numpy(g), r, n, atol)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(24, 8), softcap=2.5)])
def test_flash_attn_func_eager_and_compiled(rng, options):
    from cuflash.torch import flash_attn_func

    host = [randn(rng, (2, n, h, 64), np.float16) for n, h in ((97, 4), (130, 2), (130, 2))]
    dout_host = randn(rng, (2, 97, 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()

    def block(q, k, v):
        return flash_attn_func(q, k, v, deterministic=True, **options) * 2.0

    eager = grads_of(block, leaves(host), dout)
    compiled = grads_of(torch.compile(block, fullgraph=True), leaves(host), dout)
    assert_follows_reference([t.float() / 2 for t in eager], host, dout_host, **options)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_flash_attn_func_alibi(rng, slopes_shape):
    """alibi_slopes (nheads,) or (batch, nheads) with softcap and the causal mask: forward and gradients
    hold the 2x rule against the reference, compiled equals eager bitwise, and the slopes take no
    gradient."""
    from cuflash.torch import flash_attn_func

    host = [randn(rng, (2, n, h, 64), np.float16) for n, h in ((97, 4), (130, 2), (130, 2))]
    dout_host = randn(rng, (2, 97, 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()
    slopes_host = rng.uniform(0.01, 0.5, slopes_shape).astype(np.float32)
    slopes = torch.from_numpy(slopes_host).cuda().requires_grad_()
    options = dict(causal=True, softcap=2.5)

    def block(q, k, v):
        return flash_attn_func(q, k, v, alibi_slopes=slopes, deterministic=True, **options)

    eager = grads_of(block, leaves(host), dout)
    compiled = grads_of(torch.compile(block, fullgraph=True), leaves(host), dout)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert_follows_reference(eager, host, dout_host, alibi_slopes=slopes_host, **options)
    out = block(*leaves(host))
    (out.float() * dout.float()).sum().backward()
    assert slopes.grad is None


@pytest.mark.parametrize("alibi", [False, True])
def test_flash_attn_varlen_func(rng, alibi):
    from cuflash.torch import flash_attn_varlen_func

    lengths = [17, 0, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    host = [randn(rng, (total, h, 64), np.float16) for h in (4, 2, 2)]
    dout_host = randn(rng, (total, 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()
    cu_t = torch.from_numpy(cu).cuda()
    options = dict(causal=True)
    # ALiBi: a slope per (sequence, head)
    slopes_host = rng.uniform(0.01, 0.5, (len(lengths), 4)).astype(np.float32) if alibi else None
    slopes = torch.from_numpy(slopes_host).cuda() if alibi else None

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_t, cu_t, 130, 130, alibi_slopes=slopes, **options)

    results = grads_of(torch.compile(call, fullgraph=True), leaves(host), dout)
    options["alibi_slopes"] = slopes_host
    ref = reference.attention_varlen(*host, cu, cu, **options)
    naive = reference.attention_varlen_naive_lowp(*host, cu, cu, dtype=np.float16, **options)
    assert_close_2x(as_numpy(results[0]), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_varlen_backward(dout_host, *host, cu, cu, **options)
    naives = reference.attention_varlen_backward_naive_lowp(dout_host, *host, cu, cu, dtype=np.float16, **options)
    for g, r, n in zip(results[1:], refs, naives):
        assert_close_2x(as_numpy(g), r, n, ATOL[np.dtype(np.float16)])


def test_dropout_mask_comes_from_torch_generator(rng):
    """dropout_p: the mask of (seed, offset) = torch.randint(0, 2**62, (2,)) after torch.manual_seed,
    regenerated by the backward: forward and gradients hold the 2x rule against the reference given
    that mask; compiled equals eager bitwise under the same seed; another seed gives another output."""
    from cuflash.torch import flash_attn_func

    host = [randn(rng, (2, n, h, 64), np.float16) for n, h in ((97, 4), (130, 2), (130, 2))]
    dout_host = randn(rng, (2, 97, 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()
    p = 0.2

    def block(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=p, causal=True, deterministic=True)

    torch.manual_seed(7)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    torch.manual_seed(7)
    eager = grads_of(block, leaves(host), dout)
    torch.manual_seed(7)
    compiled = grads_of(torch.compile(block, fullgraph=True), leaves(host), dout)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    mask = reference.dropout_keep_mask(seed, offset, 2, 4, 97, 130, p)
    assert_follows_reference(eager, host, dout_host, dropout_mask=mask, dropout_p=p, causal=True)
    torch.manual_seed(8)
    assert not torch.equal(block(*leaves(host)), eager[0])


def test_varlen_dropout_follows_the_reference(rng):
    """flash_attn_varlen_func with dropout_p: the mask of the drawn (seed, offset) over each sequence's own
    positions; forward and gradients hold the 2x rule against the reference given it, and compiled equals
    eager bitwise under the same seed."""
    from cuflash.torch import flash_attn_varlen_func

    lengths, p = [17, 0, 130, 64], 0.3
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_t = torch.from_numpy(cu).cuda()
    host = [randn(rng, (int(cu[-1]), h, 64), np.float16) for h in (4, 2, 2)]
    dout_host = randn(rng, (int(cu[-1]), 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_t, cu_t, 130, 130, dropout_p=p, causal=True, deterministic=True)

    torch.manual_seed(3)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    runs = []
    for fn in (call, torch.compile(call, fullgraph=True)):
        torch.manual_seed(3)
        runs.append(grads_of(fn, leaves(host), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    mask = reference.dropout_keep_mask(seed, offset, len(lengths), 4, max(lengths), max(lengths), p)
    drop = dict(dropout_mask=mask, dropout_p=p, causal=True)
    atol = ATOL[np.dtype(np.float16)]
    assert_close_2x(as_numpy(runs[0][0]), reference.attention_varlen(*host, cu, cu, **drop),
                    reference.attention_varlen_naive_lowp(*host, cu, cu, dtype=np.float16, **drop), atol)
    refs = reference.attention_varlen_backward(dout_host, *host, cu, cu, **drop)
    naives = reference.attention_varlen_backward_naive_lowp(dout_host, *host, cu, cu, dtype=np.float16, **drop)
    for g, r, n in zip(runs[0][1:], refs, naives):
        assert_close_2x(as_numpy(g), r, n, atol)


def assert_signed_probs(s_dmask, keep, probs, seqlen_q, seqlen_k):
    """S_dmask (torch, padded) against the keep mask and the reference's softmax: each row over its
    largest entry (fp16 rounding), negated where dropped, zeros in the padding."""
    got = as_numpy(s_dmask)
    assert not np.any(got[..., seqlen_q:, :]) and not np.any(got[..., seqlen_k:])
    got = got[..., :seqlen_q, :seqlen_k]
    top = probs.max(axis=-1, keepdims=True)
    scaled = np.divide(probs, top, out=np.zeros_like(probs), where=top > 0)
    np.testing.assert_allclose(np.abs(got), scaled, rtol=2.0**-10, atol=2.0**-24)
    nonzero = scaled > 2.0**-14  # fp16's normal range: a smaller value may round to a signless 0
    assert np.array_equal(got[nonzero] > 0, keep[nonzero])
    assert np.all(got[scaled == 0] == 0)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(40, 7), alibi=True)])
def test_return_attn_probs_with_dropout(rng, options):
    """flash-attn's S_dmask: its signs are the keep mask of the drawn seed (cuflash.dropout_keep_mask on
    the device equals reference.dropout_keep_mask on the host), its values the softmax each row over its
    largest, both lengths padded to 128; the output follows the reference given that mask. None
    without dropout."""
    from cuflash.torch import flash_attn_func

    options = dict(options)
    nheads, p = 4, 0.25
    host = [randn(rng, (2, n, h, 64), np.float16) for n, h in ((97, nheads), (130, 2), (130, 2))]
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.05, 0.3, (2, nheads)).astype(np.float32)
    torch_options = {k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v for k, v in options.items()}
    torch.manual_seed(11)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    torch.manual_seed(11)
    out, lse, s_dmask = flash_attn_func(*leaves(host), dropout_p=p, return_attn_probs=True, **torch_options)
    assert s_dmask.shape == (2, nheads, 128, 256) and s_dmask.dtype == torch.float16
    keep = reference.dropout_keep_mask(seed, offset, 2, nheads, 97, 130, p)
    probs = reference.attention_probs(*host[:2], **options)
    assert_signed_probs(s_dmask, keep, probs, 97, 130)
    atol = ATOL[np.dtype(np.float16)]
    drop = dict(options, dropout_mask=keep, dropout_p=p)
    assert_close_2x(as_numpy(out), reference.attention(*host, **drop),
                    reference.attention_naive_lowp(*host, dtype=np.float16, **drop), atol)
    assert flash_attn_func(*leaves(host), return_attn_probs=True, **torch_options)[2] is None


def test_varlen_return_attn_probs_with_dropout(rng):
    """S_dmask of a packed batch: sequence b's at [b, :, :its seqlen_q, :its seqlen_k], the mask of its own
    positions; zeros past its lengths."""
    from cuflash.torch import flash_attn_varlen_func

    lengths_q, lengths_k, nheads, p = [17, 0, 130], [40, 9, 130], 3, 0.4
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    host = [randn(rng, (int(cu[-1]), h, 32), np.float16) for cu, h in ((cu_q, nheads), (cu_k, 1), (cu_k, 1))]
    torch.manual_seed(5)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    torch.manual_seed(5)
    out, _, s_dmask = flash_attn_varlen_func(*leaves(host), torch.from_numpy(cu_q).cuda(),
                                             torch.from_numpy(cu_k).cuda(), 130, 130, dropout_p=p, causal=True,
                                             return_attn_probs=True)
    assert s_dmask.shape == (3, nheads, 256, 256)
    keep = reference.dropout_keep_mask(seed, offset, 3, nheads, 130, 130, p)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        q, k = (x[cu[b]:cu[b + 1]][None] for x, cu in ((host[0], cu_q), (host[1], cu_k)))
        probs = reference.attention_probs(q, k, causal=True)
        assert_signed_probs(s_dmask[b:b + 1], keep[b:b + 1, :, :lq, :lk], probs, lq, lk)
    drop = dict(dropout_mask=keep, dropout_p=p, causal=True)
    assert_close_2x(as_numpy(out), reference.attention_varlen(*host, cu_q, cu_k, **drop),
                    reference.attention_varlen_naive_lowp(*host, cu_q, cu_k, dtype=np.float16, **drop),
                    ATOL[np.dtype(np.float16)])


def test_bad_dropout_p_is_named():
    from cuflash.torch import flash_attn_func

    q = torch.zeros((1, 8, 1, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, q, q, dropout_p=1.0)


def test_packed_forms(rng):
    """flash-attn's packed forms: the qkv-packed calls hold the 2x rule against the reference, their
    gradient being dq, dk, dv in qkv's layout; the kv-packed calls (GQA) equal the unpacked calls on
    contiguous copies, bitwise; a wrong packing is named."""
    from cuflash.torch import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                               flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                               flash_attn_varlen_qkvpacked_func)

    atol = ATOL[np.dtype(np.float16)]
    lengths = [17, 0, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_t = torch.from_numpy(cu).cuda()
    for shape, dim, call, ref_args in (
            ((2, 97, 3, 4, 64), 2, lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True), ()),
            ((int(cu[-1]), 3, 4, 64), 1,
             lambda qkv: flash_attn_varlen_qkvpacked_func(qkv, cu_t, 130, causal=True, deterministic=True), (cu, cu))):
        qkv_host = randn(rng, shape, np.float16)
        dout_host = randn(rng, np.delete(shape, dim), np.float16)
        (qkv,) = leaves([qkv_host])
        out = call(qkv)
        (grad,) = torch.autograd.grad(out, qkv, torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda())
        host = [np.take(qkv_host, i, axis=dim) for i in range(3)]
        varlen = "_varlen" if ref_args else ""
        forward, backward = getattr(reference, "attention" + varlen), getattr(reference, f"attention{varlen}_backward")
        naive_fwd = getattr(reference, f"attention{varlen}_naive_lowp")
        naive_bwd = getattr(reference, f"attention{varlen}_backward_naive_lowp")
        assert_close_2x(as_numpy(out), forward(*host, *ref_args, causal=True),
                        naive_fwd(*host, *ref_args, causal=True, dtype=np.float16), atol)
        refs = backward(dout_host, *host, *ref_args, causal=True)
        naives = naive_bwd(dout_host, *host, *ref_args, causal=True, dtype=np.float16)
        for i in range(3):
            assert_close_2x(np.take(as_numpy(grad), i, axis=dim), refs[i], naives[i], atol)

    q_host, kv_host = randn(rng, (2, 97, 4, 64), np.float16), randn(rng, (2, 130, 2, 2, 64), np.float16)
    q, kv = leaves([q_host, kv_host])
    packed = flash_attn_kvpacked_func(q, kv, window_size=(24, 8), deterministic=True)
    k, v = (t.contiguous() for t in kv.detach().unbind(2))
    assert torch.equal(packed, flash_attn_func(q, k, v, window_size=(24, 8), deterministic=True))
    q_host, kv_host = randn(rng, (int(cu[-1]), 4, 64), np.float16), randn(rng, (int(cu[-1]), 2, 2, 64), np.float16)
    q, kv = leaves([q_host, kv_host])
    packed = flash_attn_varlen_kvpacked_func(q, kv, cu_t, cu_t, 130, 130, causal=True)
    k, v = (t.contiguous() for t in kv.detach().unbind(1))
    assert torch.equal(packed, flash_attn_varlen_func(q, k, v, cu_t, cu_t, 130, 130, causal=True))
    with pytest.raises(ValueError, match="qkv"):
        flash_attn_qkvpacked_func(q)


def test_bad_alibi_slopes_are_named():
    from cuflash.torch import flash_attn_func

    q = torch.zeros((2, 8, 4, 64), dtype=torch.float16, device="cuda")
    for bad, error in ((torch.ones(3, device="cuda"), ValueError), (torch.ones(4, device="cuda").half(), TypeError)):
        with pytest.raises(error, match="alibi_slopes"):
            flash_attn_func(q, q, q, alibi_slopes=bad)


def test_inputs_with_strided_rows_are_made_contiguous(rng):
    """As flash-attn's maybe_contiguous: q, k, v whose last dim is strided are copied, with the same
    output and gradients as contiguous ones."""
    from cuflash.torch import flash_attn_func

    host = [randn(rng, (2, 40, 2, 64), np.float16) for _ in range(3)]
    dout = torch.from_numpy(randn(rng, (2, 40, 2, 64), np.float16).view(np.int16)).view(torch.float16).cuda()
    plain = leaves(host)
    strided = [torch.stack([x, x], dim=-1)[..., 0].detach().requires_grad_() for x in leaves(host)]
    assert strided[0].stride(-1) == 2
    want = grads_of(lambda q, k, v: flash_attn_func(q, k, v, causal=True), plain, dout)
    got = grads_of(lambda q, k, v: flash_attn_func(q, k, v, causal=True), strided, dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cpu_tensors_are_refused_by_name():
    from cuflash.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    q = torch.zeros((2, 8, 4, 64), dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got one on cpu"):
        flash_attn_func(q, q, q)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        flash_attn_varlen_func(q.reshape(16, 4, 64), q.reshape(16, 4, 64), q.reshape(16, 4, 64), cu, cu, 8, 8)
    # q on the GPU, another tensor on the CPU: named, not CuPy's "CPU arrays cannot be directly imported"
    q = q.cuda()
    with pytest.raises(ValueError, match="k must be a CUDA tensor on q's device, got one on cpu"):
        flash_attn_func(q, q.cpu(), q)
    packed = q.reshape(16, 4, 64)
    with pytest.raises(ValueError, match="cu_seqlens_k must be a CUDA tensor"):
        flash_attn_varlen_func(packed, packed, packed, cu.cuda(), cu, 8, 8)
    with pytest.raises(ValueError, match="cache_seqlens must be a CUDA tensor"):
        flash_attn_with_kvcache(q, q, q, cache_seqlens=torch.zeros(2, dtype=torch.int32))


def test_bad_window_size_and_flags_are_named():
    """window_size that is not a pair of ints is refused, not truncated; a flag that is not a bool is
    refused, not read by bool() ("False" is true)."""
    from cuflash.torch import flash_attn_func, flash_attn_with_kvcache

    q = torch.zeros((2, 8, 4, 64), dtype=torch.float16, device="cuda")
    for window in ((16, 2, 99), (16.9, 2)):
        with pytest.raises(TypeError, match="window_size"):
            flash_attn_func(q, q, q, window_size=window)
        with pytest.raises(TypeError, match="window_size"):
            flash_attn_with_kvcache(q, q, q, window_size=window)
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q, q, q, causal="False")
    with pytest.raises(TypeError, match="rotary_interleaved"):
        flash_attn_with_kvcache(q, q, q, rotary_interleaved="False")
    with pytest.raises(TypeError, match="softcap"):
        flash_attn_func(q, q, q, softcap="3")
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(q, q, q, softmax_scale=1e39)
    with pytest.raises(TypeError, match="num_splits"):
        flash_attn_with_kvcache(q, q, q, num_splits=2.7)


def test_kvcache_int_cache_seqlens_is_checked_on_the_host():
    """An int cache_seqlens reaches cuflash as an int, eager and compiled: the same output and caches as
    the int32 tensor of it, and cuflash's host checks: >= 0, room for the new keys in the cache (past
    it, nothing would be written) and a rotary row for every position, on a repeat of a call too."""
    from cuflash.torch import flash_attn_with_kvcache

    torch.manual_seed(0)
    q = torch.randn((2, 1, 4, 64), device="cuda").half()
    k_cache, v_cache, new = (torch.randn((2, n, 2, 64), device="cuda").half() for n in (64, 64, 1))
    cos, sin = (torch.rand((16, 16), device="cuda").half() for _ in range(2))

    def step(fn, lengths):
        caches = k_cache.clone(), v_cache.clone()
        out = fn(q, *caches, new, new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True)
        return out, *caches

    expected = step(flash_attn_with_kvcache, torch.full((2,), 10, dtype=torch.int32, device="cuda"))
    for fn in (flash_attn_with_kvcache, torch.compile(flash_attn_with_kvcache, fullgraph=True)):
        for got, want in zip(step(fn, 10), expected):
            assert torch.equal(got, want)
    for bad in (-1, 64, 10**6):
        with pytest.raises(ValueError, match="cache_seqlens"):
            step(flash_attn_with_kvcache, bad)
    with pytest.raises(ValueError, match="rotary_cos"):
        step(flash_attn_with_kvcache, 20)


def test_flash_attn_func_e4m3(rng):
    """fp8 inputs (torch.float8_e4m3fn) with descales, eager and compiled: the bf16 output of
    cuflash.attention on the uint8 codes, bitwise; mixed dtypes, dropout and 16-bit descales are refused
    by name."""
    import cupy

    import cuflash
    from cuflash.torch import flash_attn_func

    quantised = [reference.fp8_quantize(randn(rng, (2, n, 2, 64), np.float32)) for n in (97, 130, 130)]
    codes = [torch.from_numpy(bits).cuda().view(torch.float8_e4m3fn) for bits, _ in quantised]
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), (torch.from_numpy(d).cuda() for _, d in quantised)))
    options = dict(causal=True, softcap=3.0, window_size=(40, 0))
    expected = cuflash.attention(*(cupy.asarray(bits) for bits, _ in quantised), **options,
                                 **{name: cupy.asarray(d.cpu().numpy()) for name, d in descales.items()})

    def call(q, k, v):
        return flash_attn_func(q, k, v, **options, **descales)

    for fn in (call, torch.compile(call, fullgraph=True)):
        out = fn(*codes)
        assert out.dtype == torch.bfloat16
        np.testing.assert_array_equal(out.cpu().view(torch.int16).numpy(), expected.get().view(np.int16))
    fp16 = torch.zeros((2, 130, 2, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(TypeError, match=mentions("k")):
        flash_attn_func(codes[0], fp16, codes[2])
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(*codes, dropout_p=0.1)
    with pytest.raises(ValueError, match="q_descale"):
        flash_attn_func(fp16, fp16, fp16, q_descale=descales["q_descale"])


def test_flash_attn_with_kvcache_e4m3_cache(rng):
    """A torch.float8_e4m3fn cache with descales, eager and compiled: the same output and cache bits as
    cuflash.attention_with_kvcache on the uint8 codes."""
    from cuflash.torch import flash_attn_with_kvcache

    step, expected, expected_caches = e4m3_kvcache_step(rng)
    compiled = torch.compile(flash_attn_with_kvcache, fullgraph=True)
    for fn in (flash_attn_with_kvcache, compiled):
        caches = [torch.from_numpy(c).cuda().view(torch.float8_e4m3fn) for c in step["codes"]]
        out = fn(half(step["q"]), *caches, *(half(x) for x in step["new"]),
                 cache_seqlens=torch.from_numpy(step["lengths"]).cuda(),
                 k_descale=torch.from_numpy(step["descales"][0]).cuda(),
                 v_descale=torch.from_numpy(step["descales"][1]).cuda())
        np.testing.assert_array_equal(out.cpu().view(torch.int16).numpy(), expected.view(np.int16))
        for cache, want in zip(caches, expected_caches):
            np.testing.assert_array_equal(cache.view(torch.uint8).cpu().numpy(), want)


def test_flash_attn_with_kvcache_eager_and_compiled(rng):
    """Appends in place under torch.compile(fullgraph=True) too, and matches the reference step by step."""
    from cuflash.torch import flash_attn_with_kvcache

    def tensor(x):
        return torch.from_numpy(x.view(np.int16)).view(torch.float16).cuda()

    batch, capacity, nheads, nheads_kv, headdim = 2, 192, 8, 2, 64
    k_host, v_host = (randn(rng, (batch, capacity, nheads_kv, headdim), np.float16) for _ in range(2))
    k_cache, v_cache = tensor(k_host), tensor(v_host)
    lengths = np.array([0, 77], np.int32)
    compiled = torch.compile(flash_attn_with_kvcache, fullgraph=True)
    for fn in (flash_attn_with_kvcache, compiled):
        q = randn(rng, (batch, 2, nheads, headdim), np.float16)
        k, v = (randn(rng, (batch, 2, nheads_kv, headdim), np.float16) for _ in range(2))
        ref, ref_lse, k_host, v_host = reference.attention_with_kvcache(q, k_host, v_host, k, v,
                                                                        cache_seqlens=lengths, causal=True)
        naive, _, _, _ = reference.attention_with_kvcache(q, k_host, v_host, cache_seqlens=lengths + 2, causal=True,
                                                          lowp_dtype=np.float16)
        out, lse = fn(tensor(q), k_cache, v_cache, tensor(k), tensor(v), cache_seqlens=torch.from_numpy(lengths).cuda(),
                      causal=True, return_softmax_lse=True)
        assert_close_2x(as_numpy(out), ref, naive, ATOL[np.dtype(np.float16)])
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(k_cache.cpu().view(torch.int16).numpy(), k_host.view(np.int16))
        np.testing.assert_array_equal(v_cache.cpu().view(torch.int16).numpy(), v_host.view(np.int16))
        lengths = lengths + 2


def test_flash_attn_varlen_func_paged(rng):
    """block_table (chunked prefill over a paged cache), eager and compiled: bitwise equal to
    cuflash.attention_varlen on the same arrays; its gradient raises."""
    from cuflash.torch import flash_attn_varlen_func

    def tensor(x):
        return torch.from_numpy(x.view(np.int16)).view(torch.float16).cuda()

    options = dict(causal=True, softcap=3.0)
    case, expected, expected_lse = paged_prefill_case(rng, **options)
    q, k_pages, v_pages = tensor(case["q"]), *(tensor(p) for p in case["pages"])
    cu_q, cu_k, table = (torch.from_numpy(x).cuda() for x in (*case["cu"], case["table"]))

    def call(q, k_pages, v_pages):
        return flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, *case["lengths"], block_table=table,
                                      return_attn_probs=True, **options)

    for fn in (call, torch.compile(call, fullgraph=True)):
        out, lse, _ = fn(q, k_pages, v_pages)
        np.testing.assert_array_equal(out.cpu().view(torch.int16).numpy(), expected.view(np.int16))
        np.testing.assert_array_equal(lse.cpu().numpy(), expected_lse)
    out, _, _ = call(q.clone().requires_grad_(), k_pages, v_pages)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.float().sum().backward()


@pytest.mark.parametrize("headdim", [59, 111])
def test_head_dims_flash_attn_pads(rng, headdim):
    """Head dims that are not a multiple of 8 run padded with zero columns, as in flash-attn: forward and
    gradients against the reference at the caller's head dim (scale 1 / sqrt(headdim)), eager and
    compiled bitwise equal; the varlen form's output too."""
    from cuflash.torch import flash_attn_func, flash_attn_varlen_func

    host = [randn(rng, (2, n, h, headdim), np.float16) for n, h in ((70, 4), (90, 2), (90, 2))]
    dout_host = randn(rng, (2, 70, 4, headdim), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()

    def block(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    eager = grads_of(block, leaves(host), dout)
    assert eager[0].shape == (2, 70, 4, headdim)
    assert_follows_reference(eager, host, dout_host, causal=True)
    for a, b in zip(eager, grads_of(torch.compile(block, fullgraph=True), leaves(host), dout)):
        assert torch.equal(a, b)

    cu_q = torch.tensor([0, 70, 140], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32, device="cuda")
    packed = [x.detach().flatten(0, 1).requires_grad_() for x in leaves(host)]
    out = flash_attn_varlen_func(*packed, cu_q, cu_k, 70, 90, causal=True)
    assert_close_2x(as_numpy(out.unflatten(0, (2, 70))), reference.attention(*host, causal=True),
                    reference.attention_naive_lowp(*host, dtype=np.float16, causal=True), ATOL[np.dtype(np.float16)])


def test_kvcache_head_dim_flash_attn_pads(rng):
    """A head dim of 59 in flash_attn_with_kvcache: the step attends and appends in place as the
    reference does (the caches padded in copies, the new rows copied back)."""
    from cuflash.torch import flash_attn_with_kvcache

    def tensor(x):
        return torch.from_numpy(x.view(np.int16)).view(torch.float16).cuda()

    batch, capacity, nheads, nheads_kv, headdim = 2, 100, 6, 3, 59
    k_host, v_host = (randn(rng, (batch, capacity, nheads_kv, headdim), np.float16) for _ in range(2))
    q, k, v = (randn(rng, (batch, 3, n, headdim), np.float16) for n in (nheads, nheads_kv, nheads_kv))
    lengths = np.array([0, 41], np.int32)
    ref, _, k_after, v_after = reference.attention_with_kvcache(q, k_host, v_host, k, v, cache_seqlens=lengths,
                                                                causal=True)
    naive, _, _, _ = reference.attention_with_kvcache(q, k_host, v_host, k, v, cache_seqlens=lengths, causal=True,
                                                      lowp_dtype=np.float16)
    k_cache, v_cache = tensor(k_host), tensor(v_host)
    out = flash_attn_with_kvcache(tensor(q), k_cache, v_cache, tensor(k), tensor(v),
                                  cache_seqlens=torch.from_numpy(lengths).cuda(), causal=True)
    assert_close_2x(as_numpy(out), ref, naive, ATOL[np.dtype(np.float16)])
    np.testing.assert_array_equal(k_cache.cpu().view(torch.int16).numpy(), k_after.view(np.int16))
    np.testing.assert_array_equal(v_cache.cpu().view(torch.int16).numpy(), v_after.view(np.int16))
