"""cuflash.torch: flash-attn's function names as torch custom ops, eager and under
torch.compile(fullgraph=True), against cuflash.reference (2x rule) and each other (bitwise)."""

import numpy as np
import pytest

from cuflash import reference
from tests.numerics import ATOL, assert_close_2x, randn

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def leaves(host):
    return [torch.from_numpy(x.view(np.int16)).view(torch.float16).cuda().requires_grad_() for x in host]


def grads_of(fn, tensors, dout):
    out = fn(*tensors)
    return (out, *torch.autograd.grad(out, tensors, dout))


def as_numpy(t):
    return t.detach().float().cpu().numpy()


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
    ref = reference.attention(*host, **options)
    naive = reference.attention_naive_lowp(*host, dtype=np.float16, **options)
    assert_close_2x(as_numpy(eager[0]) / 2, ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_backward(dout_host, *host, **options)
    naives = reference.attention_backward_naive_lowp(dout_host, *host, dtype=np.float16, **options)
    for g, r, n in zip(eager[1:], refs, naives):
        assert_close_2x(as_numpy(g) / 2, r, n, ATOL[np.dtype(np.float16)])
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_flash_attn_varlen_func(rng):
    from cuflash.torch import flash_attn_varlen_func

    lengths = [17, 0, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    host = [randn(rng, (total, h, 64), np.float16) for h in (4, 2, 2)]
    dout_host = randn(rng, (total, 4, 64), np.float16)
    dout = torch.from_numpy(dout_host.view(np.int16)).view(torch.float16).cuda()
    cu_t = torch.from_numpy(cu).cuda()

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_t, cu_t, 130, 130, causal=True)

    results = grads_of(torch.compile(call, fullgraph=True), leaves(host), dout)
    ref = reference.attention_varlen(*host, cu, cu, causal=True)
    naive = reference.attention_varlen_naive_lowp(*host, cu, cu, causal=True, dtype=np.float16)
    assert_close_2x(as_numpy(results[0]), ref, naive, ATOL[np.dtype(np.float16)])
    refs = reference.attention_varlen_backward(dout_host, *host, cu, cu, causal=True)
    naives = reference.attention_varlen_backward_naive_lowp(dout_host, *host, cu, cu, causal=True, dtype=np.float16)
    for g, r, n in zip(results[1:], refs, naives):
        assert_close_2x(as_numpy(g), r, n, ATOL[np.dtype(np.float16)])


def test_dropout_is_refused():
    from cuflash.torch import flash_attn_func

    q = torch.zeros((1, 8, 1, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_func(q, q, q, dropout_p=0.1)


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
