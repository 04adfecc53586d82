"""Inputs, tolerances and checks shared by the test modules."""

import os

import ml_dtypes
import numpy as np

# The 16-bit input dtypes every kernel takes, and the atol of the 2x rule for each.
DTYPES = [np.float16, ml_dtypes.bfloat16]
ATOL = {np.dtype(np.float16): 1e-3, np.dtype(ml_dtypes.bfloat16): 5e-3}


def assert_close_2x(out, ref64, naive, atol):
    """Assert out is at most twice as far from ref64 as naive is, plus atol.

    out: the result under test; ref64: the float64 reference; naive: the
    same computation done naively in the input's low-precision dtype.
    """
    out, ref64, naive = (np.asarray(x, dtype=np.float64) for x in (out, ref64, naive))
    assert out.shape == ref64.shape, f"shape {out.shape} != reference {ref64.shape}"
    n_nan = int(np.isnan(out).sum())
    assert n_nan == 0, f"{n_nan} NaN values in output"
    err = np.abs(out - ref64).max(initial=0.0)
    naive_err = np.abs(naive - ref64).max(initial=0.0)
    bound = 2 * naive_err + atol
    assert err <= bound, (
        f"max abs error {err:.3e} > bound {bound:.3e} "
        f"(naive low-precision error {naive_err:.3e}, atol {atol:.1e})"
    )


def ring_rounding(world: int, want, dtype=np.float16) -> float:
    """The extra tolerance of a gradient summed over a ring's steps: each of the `world` steps
    returns its share rounded to `dtype` before the fp32 sum, up to `world` roundings of half an
    ulp of the largest entry where a one-pass kernel has one."""
    return world * 0.5 * float(np.finfo(dtype).eps) * float(np.abs(want).max())


def check_lse(lse, ref_lse):
    """A device lse against the float64 reference: exactly -inf for rows that see no key, finite and
    close elsewhere."""
    lse = lse.get().astype(np.float64)
    assert lse.shape == ref_lse.shape
    masked = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], ref_lse[~masked], rtol=1e-3, atol=1e-3)


def randn(rng, shape, dtype):
    """Standard normal float32 draws rounded to dtype: a host array from a NumPy
    generator, a device array from a CuPy one."""
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def mentions(arg):
    """Regex matching the argument's name as a word in an error message."""
    return rf"\b{arg}\b"


def _host_qkv(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim):
    return (
        randn(rng, (batch, nq, nheads, headdim), dtype),
        randn(rng, (batch, nk, nheads_kv, headdim), dtype),
        randn(rng, (batch, nk, nheads_kv, headdim), dtype),
    )


def make_qkv(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim):
    """Host (q, k, v) drawn with `randn` and device copies of them."""
    import cupy

    host = _host_qkv(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim)
    return host, tuple(cupy.asarray(x) for x in host)


def make_inputs(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim):
    """Host (dout, q, k, v) drawn with `randn` and device copies of them."""
    import cupy

    dout = randn(rng, (batch, nq, nheads, headdim), dtype)
    host = (dout, *_host_qkv(rng, dtype, batch, nq, nk, nheads, nheads_kv, headdim))
    return host, tuple(cupy.asarray(x) for x in host)


# The fuzz suites' variables (tests/test_fuzz_gpu.py explains them): base seed, case count, which
# of several processes this one is ("i/n": cases i, i + n, i + 2n, ...) and the first case run.
FUZZ_SEED = int(os.environ.get("CUFLASH_FUZZ_SEED", 0x5EED_F1A5))
FUZZ_CASES = int(os.environ.get("CUFLASH_FUZZ_CASES", 200))


def fuzz_indices(count):
    """The indices of `count` fuzz cases that this process runs (CUFLASH_FUZZ_SHARD, default all)."""
    shard, shards = (int(x) for x in os.environ.get("CUFLASH_FUZZ_SHARD", "0/1").split("/"))
    first = int(os.environ.get("CUFLASH_FUZZ_FROM", 0))
    return [i for i in range(shard, count, shards) if i >= first]


def e4m3_kvcache_step(rng, batch=2, capacity=160, nheads=8, nheads_kv=2, headdim=64):
    """A decoding step over an e4m3 cache for the framework wrappers to repeat: host inputs (cache
    codes, lengths, descales, q, new k and v) and the CuPy call's results on them (out; the caches'
    codes after the append), which a wrapper's must equal bit for bit."""
    import cupy

    import cuflash
    from cuflash import reference

    codes = [reference.kvcache_quantize(8 * randn(rng, (batch * capacity, nheads_kv, headdim), np.float32),
                                        np.ones(nheads_kv)).reshape(batch, capacity, nheads_kv, headdim)
             for _ in range(2)]
    step = dict(codes=codes, lengths=np.array([3, capacity - 10], np.int32)[:batch],
                descales=[rng.uniform(0.05, 0.2, (batch, nheads_kv)).astype(np.float32) for _ in range(2)],
                q=randn(rng, (batch, 1, nheads, headdim), np.float16),
                new=[randn(rng, (batch, 1, nheads_kv, headdim), np.float16) for _ in range(2)])
    caches = [cupy.asarray(c) for c in codes]
    out = cuflash.attention_with_kvcache(cupy.asarray(step["q"]), *caches, *(cupy.asarray(x) for x in step["new"]),
                                         cache_seqlens=cupy.asarray(step["lengths"]),
                                         k_descale=cupy.asarray(step["descales"][0]),
                                         v_descale=cupy.asarray(step["descales"][1]))
    return step, out.get(), [c.get() for c in caches]


def paged_prefill_case(rng, page_size=32, nheads=4, nheads_kv=2, headdim=64, **options):
    """A chunked prefill over a paged cache for the framework wrappers to repeat: host inputs (q, the
    pages, cu_seqlens, block_table, lengths) and cuflash.attention_varlen's output and lse on them,
    which a wrapper's must equal bit for bit."""
    import cupy

    import cuflash

    lengths_k, lengths_q = [130, 17, 0, 64], [33, 17, 0, 1]
    batch = len(lengths_k)
    pages_per = max(-(-n // page_size) for n in lengths_k)
    num_pages = batch * pages_per + 1
    case = dict(q=randn(rng, (sum(lengths_q), nheads, headdim), np.float16),
                pages=[randn(rng, (num_pages, page_size, nheads_kv, headdim), np.float16) for _ in range(2)],
                cu=[np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k)],
                table=rng.permutation(num_pages)[:batch * pages_per].reshape(batch, pages_per).astype(np.int32),
                lengths=(max(lengths_q), max(lengths_k)))
    out, lse = cuflash.attention_varlen(cupy.asarray(case["q"]), *(cupy.asarray(p) for p in case["pages"]),
                                        *(cupy.asarray(c) for c in case["cu"]), *case["lengths"],
                                        block_table=cupy.asarray(case["table"]), return_lse=True, **options)
    return case, out.get(), lse.get()


def jax_nn_mask(nq, nk, causal, window):
    """jax.nn.dot_product_attention's mask, from its definition (top-left aligned): key j <= i under
    causal, i - left <= j <= i + right under a window (an int: the same bound on either side)."""
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    mask = np.ones((nq, nk), bool)
    if causal:
        mask &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        mask &= (i - left <= j) & (j <= i + right)
    return mask
