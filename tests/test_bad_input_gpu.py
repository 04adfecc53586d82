"""Bad input that reached the kernels: outputs that share memory with inputs or with themselves,
flags given as strings, KV-cache arguments whose problems only the host could see (repeated cache
rows, rotary tables too short for a repeated call's lengths, page size 0, int32 positions), and the
fp8 quantiser's input. Each gets an error that names the argument; legal layouts that look alike
(dq, dk, dv as views of one dqkv array) keep working."""

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import fp8
from tests.numerics import mentions, randn

pytestmark = pytest.mark.gpu


def qkv(rng, batch=1, seqlen=64, nheads=2, headdim=64):
    return [cupy.asarray(randn(rng, (batch, seqlen, nheads, headdim), np.float16)) for _ in range(3)]


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_out_sharing_an_input_is_refused(rng, name):
    q, k, v = qkv(rng)
    inputs = {"q": q, "k": k, "v": v}
    with pytest.raises(ValueError, match=f"out must not share memory with {name}"):
        cuflash.attention(q, k, v, out=inputs[name])


def test_gradients_sharing_memory_are_refused(rng):
    q, k, v = qkv(rng)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.asarray(randn(rng, q.shape, np.float16))
    with pytest.raises(ValueError, match="dk must not share memory with k"):
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dk=k,
                                   dv=cupy.empty_like(v))
    dk = cupy.empty_like(k)
    with pytest.raises(ValueError, match="dk must not share memory with dv"):
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=cupy.empty_like(q), dk=dk, dv=dk)


def test_packed_gradient_views_are_accepted(rng):
    """dq, dk, dv as interleaved views of one (batch, seqlen, 3, nheads, headdim) array share no element:
    the same gradients as separate arrays."""
    q, k, v = qkv(rng)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dout = cupy.asarray(randn(rng, q.shape, np.float16))
    dqkv = cupy.full((*q.shape[:2], 3, *q.shape[2:]), np.nan, np.float16)
    cuflash.attention_backward(dout, q, k, v, out, lse, dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
    for got, want in zip((dqkv[:, :, i] for i in range(3)), cuflash.attention_backward(dout, q, k, v, out, lse)):
        assert bool((got == want).all())


@pytest.mark.parametrize("make", [
    lambda q: cupy.broadcast_to(cupy.empty((1, *q.shape[1:]), q.dtype), (2, *q.shape[1:])),
    lambda q: cupy.empty(q.shape, q.dtype)[:, ::-1],
])
def test_out_without_positive_strides_is_refused(rng, make):
    q, k, v = qkv(rng, batch=2)
    with pytest.raises(ValueError, match="out must have positive strides"):
        cuflash.attention(q, k, v, out=make(q))


def test_string_flags_are_refused_before_and_after_a_plan(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=mentions("causal")):
        cuflash.attention(q, k, v, causal="False")
    cuflash.attention(q, k, v, causal=True)  # a plan for this signature now exists
    with pytest.raises(TypeError, match=mentions("causal")):
        cuflash.attention(q, k, v, causal="False")
    assert bool((cuflash.attention(q, k, v, causal=np.bool_(True)) == cuflash.attention(q, k, v, causal=True)).all())


def kv_step(rng, batch=2, capacity=64, nheads=4, nheads_kv=2, headdim=64, n_new=1):
    cache = [cupy.asarray(randn(rng, (batch, capacity, nheads_kv, headdim), np.float16)) for _ in range(2)]
    q = cupy.asarray(randn(rng, (batch, 1, nheads, headdim), np.float16))
    new = [cupy.asarray(randn(rng, (batch, n_new, nheads_kv, headdim), np.float16)) for _ in range(2)]
    return q, cache, new


def test_one_array_as_both_caches_is_refused_when_appending(rng):
    q, (k_cache, _), (k, v) = kv_step(rng)
    with pytest.raises(ValueError, match="k_cache must not share memory with v_cache"):
        cuflash.attention_with_kvcache(q, k_cache, k_cache, k, v, cache_seqlens=3)


def test_repeated_cache_rows_are_refused_when_appending(rng):
    q, cache, new = kv_step(rng)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        cuflash.attention_with_kvcache(q, *cache, *new, cache_seqlens=3,
                                       cache_batch_idx=np.array([1, 1], np.int32))
    cuflash.attention_with_kvcache(q, *cache, cache_seqlens=3, cache_batch_idx=np.array([1, 1], np.int32))


def test_rotary_rows_are_checked_on_a_repeated_call(rng):
    """A repeated signature with an int cache_seqlens, and cache_seqlens None, check the rotary tables'
    rows as a first call does (the kernels would clamp to the last row)."""
    q, cache, new = kv_step(rng)
    cos = cupy.asarray(randn(rng, (8, 16), np.float16))
    sin = cupy.asarray(randn(rng, (8, 16), np.float16))
    cuflash.attention_with_kvcache(q, *cache, *new, cache_seqlens=2, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="rotary_cos"):
        cuflash.attention_with_kvcache(q, *cache, *new, cache_seqlens=40, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="rotary_cos"):
        cuflash.attention_with_kvcache(q, *cache, *new, rotary_cos=cos, rotary_sin=sin)


def test_page_size_zero_and_int32_capacity(rng):
    q = cupy.asarray(randn(rng, (1, 1, 2, 64), np.float16))
    empty_pages = cupy.zeros((4, 0, 2, 64), np.float16)
    table = cupy.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="page_size"):
        cuflash.attention_with_kvcache(q, empty_pages, empty_pages, cache_seqlens=0, block_table=table)
    pages = cupy.zeros((1, 2**16, 2, 64), np.float16)
    with pytest.raises(ValueError, match="int32"):
        cuflash.attention_with_kvcache(q, pages, pages, cache_seqlens=0, block_table=cupy.zeros((1, 2**15), np.int32))


def test_paged_varlen_checks_host_offsets_first(rng):
    q = cupy.asarray(randn(rng, (4, 2, 64), np.float16))
    pages = cupy.zeros((2, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match=mentions("cu_seqlens_k")):
        cuflash.attention_varlen(q, pages, pages, np.array([0, 4], np.int32), np.array([], np.int32), 4, 16,
                                 block_table=cupy.zeros((1, 1), np.int32))


@pytest.mark.parametrize("make, error", [
    (lambda: np.zeros((1, 4, 1, 16), np.float32), TypeError),
    (lambda: cupy.zeros((4, 1, 16), cupy.float32), ValueError),
    (lambda: cupy.zeros((1, 0, 1, 16), cupy.float32), ValueError),
    (lambda: cupy.zeros((1, 4, 1, 16), cupy.int32), TypeError),
])
def test_quantize_e4m3_checks_its_input(make, error):
    with pytest.raises(error, match=mentions("x")):
        fp8.quantize_e4m3(make())
