"""cuflash.torch_fa3: flash-attn 3's interface (names, positional order, return values) on cuflash's
torch ops, bitwise against the flash-attn 2 forms of cuflash.torch and against the reference."""

import numpy as np
import pytest

from cuflash import reference
from tests.numerics import ATOL, assert_close_2x, e4m3_kvcache_step, randn
from tests.torch_support import half, leaves, torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("torch_cuda")]


def test_flash_attn_func_positional_order_and_lse(rng):
    """FA3's (q, k, v, softmax_scale, causal, ...) order; return_attn_probs gives (out, lse); gradients
    are those of cuflash.torch.flash_attn_func, bit for bit."""
    from cuflash import torch as fa2
    from cuflash import torch_fa3

    host = [randn(rng, (2, n, h, 64), np.float16) for n, h in ((97, 4), (130, 2), (130, 2))]
    dout = half(randn(rng, (2, 97, 4, 64), np.float16))
    scale = 0.09
    mine, theirs = leaves(host), leaves(host)
    out, lse = torch_fa3.flash_attn_func(*mine, scale, True, None, None, None, None, (-1, -1), 0, 0.0, 1, None, True,
                                         0, True)
    want, want_lse, _ = fa2.flash_attn_func(*theirs, softmax_scale=scale, causal=True, deterministic=True,
                                            return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for a, b in zip(torch.autograd.grad(out, mine, dout), torch.autograd.grad(want, theirs, dout)):
        assert torch.equal(a, b)
    ref = reference.attention(*host, causal=True, softmax_scale=scale)
    naive = reference.attention_naive_lowp(*host, dtype=np.float16, causal=True, softmax_scale=scale)
    assert_close_2x(out.detach().float().cpu().numpy(), ref, naive, ATOL[np.dtype(np.float16)])
    assert isinstance(torch_fa3.flash_attn_func(*theirs, scale, True), torch.Tensor)


def test_flash_attn_qkvpacked_func_both_layouts(rng):
    """(batch, seqlen, 3, nheads, headdim), and num_heads_q's (batch, seqlen, nq + 2 nkv, headdim) (GQA)."""
    from cuflash import torch_fa3

    qkv = half(randn(rng, (2, 77, 3, 4, 64), np.float16))
    want = torch_fa3.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, True)
    assert torch.equal(torch_fa3.flash_attn_qkvpacked_func(qkv, causal=True), want)
    gqa = half(randn(rng, (2, 77, 4 + 2 * 2, 64), np.float16))
    want = torch_fa3.flash_attn_func(gqa[:, :, :4], gqa[:, :, 4:6], gqa[:, :, 6:], window_size=(16, 3))
    assert torch.equal(torch_fa3.flash_attn_qkvpacked_func(gqa, window_size=(16, 3), num_heads_q=4), want)
    with pytest.raises(ValueError, match="num_heads_q"):
        torch_fa3.flash_attn_qkvpacked_func(gqa, num_heads_q=3)


def test_flash_attn_varlen_func(rng):
    from cuflash import torch as fa2
    from cuflash import torch_fa3

    lengths = [17, 0, 130, 64]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).cuda()
    q, k, v = (half(randn(rng, (int(cu[-1]), h, 64), np.float16)) for h in (4, 2, 2))
    out, lse = torch_fa3.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, None, None, None, True, softcap=5.0,
                                                return_attn_probs=True)
    want, want_lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True, softcap=5.0,
                                                   return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_flash_attn_varlen_func_seqused(rng):
    """seqused_q and seqused_k (flash-attn 3's): the reference's rows in use with bottom-right masks,
    0 in the other rows of out and of the gradients."""
    from cuflash import torch_fa3

    spans, used = [40, 0, 130], ([17, 0, 100], [40, 0, 64])
    cu_host = np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)
    cu = torch.from_numpy(cu_host).cuda()
    used_q, used_k = (torch.tensor(u, dtype=torch.int32).cuda() for u in used)
    host = [randn(rng, (170, h, 64), np.float16) for h in (4, 2, 2)]
    dout = randn(rng, (170, 4, 64), np.float16)
    q, k, v = leaves(host)
    out = torch_fa3.flash_attn_varlen_func(q, k, v, cu, cu, 100, 64, used_q, used_k, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), half(dout))
    extra = dict(causal=True, seqused_q=np.array(used[0]), seqused_k=np.array(used[1]))
    ref = reference.attention_varlen(*host, cu_host, cu_host, **extra)
    naive = reference.attention_varlen_naive_lowp(*host, cu_host, cu_host, dtype=np.float16, **extra)
    assert_close_2x(out.detach().float().cpu().numpy(), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_varlen_backward(dout, *host, cu_host, cu_host, **extra)
    naives = reference.attention_varlen_backward_naive_lowp(dout, *host, cu_host, cu_host, dtype=np.float16, **extra)
    for g, r, n in zip(grads, refs, naives):
        assert_close_2x(g.float().cpu().numpy(), r, n, ATOL[np.dtype(np.float16)])


def test_flash_attn_with_kvcache_page_table_and_returns(rng):
    """page_table is cuflash's block_table; return_softmax_lse gives flash-attn 3's four values."""
    from cuflash import torch as fa2
    from cuflash import torch_fa3

    batch, page_size, pages_each, nheads, nheads_kv, headdim = 2, 16, 6, 8, 2, 64
    pages = [half(randn(rng, (batch * pages_each, page_size, nheads_kv, headdim), np.float16)) for _ in range(2)]
    table = torch.from_numpy(rng.permutation(batch * pages_each).astype(np.int32).reshape(batch, pages_each)).cuda()
    lengths = torch.tensor([5, 70], dtype=torch.int32).cuda()
    q = half(randn(rng, (batch, 1, nheads, headdim), np.float16))
    new = [half(randn(rng, (batch, 1, nheads_kv, headdim), np.float16)) for _ in range(2)]
    mine = [p.clone() for p in pages]
    result = torch_fa3.flash_attn_with_kvcache(q, *mine, *new, cache_seqlens=lengths, page_table=table, causal=True,
                                               return_softmax_lse=True)
    want, want_lse = fa2.flash_attn_with_kvcache(q, *pages, *new, cache_seqlens=lengths, block_table=table,
                                                 causal=True, return_softmax_lse=True)
    assert len(result) == 4 and result[2].numel() == 0 and result[3].numel() == 0
    assert torch.equal(result[0], want) and torch.equal(result[1], want_lse)
    for a, b in zip(mine, pages):
        assert torch.equal(a, b)


def test_flash_attn_with_kvcache_broadcast_descales(rng):
    """flash-attn 3 reads descales through their strides: a broadcast (expand) view is taken."""
    from cuflash import torch_fa3

    step, expected, _ = e4m3_kvcache_step(rng)
    caches = [torch.from_numpy(c).cuda().view(torch.float8_e4m3fn) for c in step["codes"]]
    descales = [torch.from_numpy(d).cuda() for d in step["descales"]]
    # the step's descales as one row broadcast over the batch where the rows are equal, else as they are
    views = [d[:1].expand_as(d) if bool((d == d[:1]).all()) else d for d in descales]
    out = torch_fa3.flash_attn_with_kvcache(half(step["q"]), *caches, *(half(x) for x in step["new"]),
                                            cache_seqlens=torch.from_numpy(step["lengths"]).cuda(),
                                            k_descale=views[0], v_descale=views[1])
    np.testing.assert_array_equal(out.cpu().view(torch.int16).numpy(), expected.view(np.int16))
    row = [d[:1].expand_as(d) for d in descales]
    out = torch_fa3.flash_attn_with_kvcache(half(step["q"]), *[c.clone() for c in caches],
                                            cache_seqlens=torch.from_numpy(step["lengths"]).cuda(),
                                            k_descale=row[0], v_descale=row[1])
    assert out.isfinite().all()


def test_flash_attn_combine_matches_whole_attention(rng):
    """Two halves of the keys, each one's out and lse in flash-attn 3's combine layout, merge into the
    attention over all keys; the merged lse is the whole call's."""
    from cuflash import torch as fa2
    from cuflash import torch_fa3

    q, k, v = (half(randn(rng, (2, 33, 4, 64), np.float16)) for _ in range(3))
    parts = [fa2.flash_attn_func(q, k[:, s], v[:, s], return_attn_probs=True)[:2]
             for s in (slice(0, 20), slice(20, 33))]
    out_partial = torch.stack([o.float() for o, _ in parts])                       # (S, B, N, H, D)
    lse_partial = torch.stack([lse.transpose(1, 2) for _, lse in parts])           # (S, B, N, H)
    out, lse = torch_fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    whole, whole_lse, _ = fa2.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.dtype == torch.float16 and lse.shape == (2, 33, 4)
    torch.testing.assert_close(out.float(), whole.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, whole_lse.transpose(1, 2), atol=1e-4, rtol=1e-5)
    into = torch.full_like(out_partial[0], float("nan"))
    merged, _ = torch_fa3.flash_attn_combine(out_partial, lse_partial, out=into)
    assert merged is into and into.isfinite().all()


@pytest.mark.parametrize("call, name", [
    (lambda f, q: f.flash_attn_func(q, q, q, qv=q), "qv"),
    (lambda f, q: f.flash_attn_func(q, q, q, attention_chunk=64), "attention_chunk"),
    (lambda f, q: f.flash_attn_with_kvcache(q, q, q, cu_seqlens_q=q), "cu_seqlens_q"),
    (lambda f, q: f.flash_attn_with_kvcache(q, q, q, q_descale=q), "q_descale"),
    (lambda f, q: f.flash_attn_with_kvcache(q, q, q, rotary_seqlens=q), "rotary_seqlens"),
])
def test_missing_features_are_named(call, name):
    from cuflash import torch_fa3

    q = torch.zeros((1, 8, 1, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(NotImplementedError, match=name):
        call(torch_fa3, q)


def test_tuning_hints_are_accepted(rng):
    from cuflash import torch_fa3

    q, k, v = (half(randn(rng, (1, 40, 2, 64), np.float16)) for _ in range(3))
    want = torch_fa3.flash_attn_func(q, k, v, causal=True)
    got = torch_fa3.flash_attn_func(q, k, v, causal=True, num_splits=4, pack_gqa=True, sm_margin=8)
    assert torch.equal(got, want)
