"""Problems past 2^31 elements and a million tokens: 64-bit index arithmetic, checked on sampled rows.

Selected by an environment variable, since one run takes about 3.5 minutes (H200) and 40 GiB of device memory:

    CUFLASH_LARGE=1 python -m pytest -q tests/test_large_gpu.py

q, k, v, out and the gradients have 1 x (2^20 + 17) x 16 x 128 elements each, 2^31 + 34,816: every
tensor's last rows lie past the reach of a 32-bit element index. The causal forward and backward
run on the whole problem; the float64 reference (cuflash.reference) is computed on three blocks of
rows, at the start, the middle and the end, for the first and the last head. Block rows r0..r1 are
exact by themselves: with causal bottom-right alignment, queries q[r0:r1] against keys k[:r1] are
those rows of the whole problem. The end block also fixes dk and dv of its keys, which only its
rows see.

The extra device memory of each call is measured from a fresh memory pool (its total afterwards is
the call's high-water mark) and held to the documented O(N) buffers.
"""

import os
import time

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import reference
from tests.numerics import ATOL, assert_close_2x, check_lse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("CUFLASH_LARGE") != "1", reason="set CUFLASH_LARGE=1 to run"),
]

SEQLEN = (1 << 20) + 17
NHEADS = 16
HEADDIM = 128
BLOCK = 32  # rows per checked block
HEADS_CHECKED = (0, NHEADS - 1)
MiB = 1 << 20


def device_normal(shape, seed):
    """Standard normal fp16 draws made on the device a slice at a time (no float32 copy of the whole)."""
    out = cupy.empty(shape, cupy.float16)
    gen = cupy.random.default_rng(seed)
    step = 1 << 16
    for start in range(0, shape[1], step):
        stop = min(start + step, shape[1])
        out[:, start:stop] = gen.standard_normal((shape[0], stop - start, *shape[2:]), dtype=cupy.float32)
    return out


def peak_extra(call):
    """(result, device bytes the call allocated at most): the call runs on a fresh memory pool, whose
    total afterwards bounds its high-water mark from above (freed blocks it could not reuse count)."""
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        result = call()
        cupy.cuda.get_current_stream().synchronize()
    return result, pool.total_bytes()


def host_rows(x, rows, head):
    """x[0, rows, head] on the host as (1, len, 1, headdim)."""
    return cupy.asnumpy(x[:, rows, head:head + 1])


@pytest.fixture(scope="module")
def problem():
    shape = (1, SEQLEN, NHEADS, HEADDIM)
    elements = int(np.prod(shape))
    assert elements > 2**31
    need = 8 * 2 * elements + 4 * elements  # q, k, v, dout, out, the gradients; the fp32 dq accumulator
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free device memory, {free / 2**30:.0f} GiB free")
    q, k, v, dout = (device_normal(shape, seed) for seed in range(4))
    start = time.perf_counter()
    (out, lse), fwd_peak = peak_extra(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True))
    middle = time.perf_counter()
    grads, bwd_peak = peak_extra(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
    print(f"\n{SEQLEN} tokens, causal: forward {middle - start:.1f} s, backward {time.perf_counter() - middle:.1f} s "
          "(first calls: compilation included)")
    return dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, grads=grads, fwd_peak=fwd_peak, bwd_peak=bwd_peak)


BLOCKS = {"start": slice(0, BLOCK), "middle": slice(SEQLEN // 2, SEQLEN // 2 + BLOCK),
          "end": slice(SEQLEN - BLOCK, SEQLEN)}


@pytest.mark.parametrize("head", HEADS_CHECKED)
@pytest.mark.parametrize("block", list(BLOCKS))
def test_causal_forward_and_backward_rows_match_the_reference(problem, block, head):
    rows = BLOCKS[block]
    keys = slice(0, rows.stop)
    q = host_rows(problem["q"], rows, head)
    k, v = (host_rows(problem[name], keys, head) for name in "kv")
    dout = host_rows(problem["dout"], rows, head)
    dtype = np.float16

    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    naive = reference.attention_naive_lowp(q, k, v, causal=True, dtype=dtype)
    assert_close_2x(host_rows(problem["out"], rows, head), ref, naive, ATOL[np.dtype(dtype)])
    check_lse(problem["lse"][:, head:head + 1, rows], ref_lse)

    dq, dk, dv = problem["grads"]
    refs = reference.attention_backward(dout, q, k, v, causal=True)
    naives = reference.attention_backward_naive_lowp(dout, q, k, v, causal=True, dtype=dtype)
    atol = ATOL[np.dtype(dtype)]
    assert_close_2x(host_rows(dq, rows, head), refs[0], naives[0], atol)
    if block == "end":  # only these rows see the block's keys
        for got, ref_grad, naive_grad in zip((dk, dv), refs[1:], naives[1:]):
            assert_close_2x(host_rows(got, rows, head), ref_grad[:, rows], naive_grad[:, rows], atol)


def test_extra_memory_is_the_outputs_and_documented_workspaces(problem):
    """Forward: out and lse. Backward: dq, dk, dv, the fp32 dq accumulator and the per-row buffers
    (softmax lse in log2 and rowsum(dout * out): two floats a row, bounded here with room for four),
    each O(N)."""
    q = problem["q"]
    row_floats = NHEADS * SEQLEN * 4  # one float per (head, row)
    fwd_bound = q.nbytes + row_floats + MiB
    bwd_bound = 3 * q.nbytes + 2 * q.nbytes + 4 * row_floats + 4 * MiB
    print(f"peak extra device memory at {SEQLEN} tokens: forward {problem['fwd_peak'] / MiB:.0f} MiB "
          f"(bound {fwd_bound / MiB:.0f}), backward {problem['bwd_peak'] / MiB:.0f} MiB "
          f"(bound {bwd_bound / MiB:.0f}); q is {q.nbytes / MiB:.0f} MiB")
    assert problem["fwd_peak"] <= fwd_bound
    assert problem["bwd_peak"] <= bwd_bound
