"""CUDA graph capture: forward + backward recorded once with CuPy's stream capture and replayed on
changed input contents, against eager calls; calls that cannot be captured raise a clear error."""

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import compile as cf_compile
from cuflash import kernel_call
from tests.numerics import randn

pytestmark = pytest.mark.gpu

REPLAYS = 100


def buffers(batch, nq, nk, nheads, nheads_kv, headdim):
    q = cupy.empty((batch, nq, nheads, headdim), cupy.float16)
    k = cupy.empty((batch, nk, nheads_kv, headdim), cupy.float16)
    v = cupy.empty_like(k)
    dout = cupy.empty_like(q)
    return q, k, v, dout


def fill(gen, *arrays):
    for x in arrays:
        x[...] = randn(gen, x.shape, x.dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", [(2, 97, 130, 4, 2, 64), (1, 257, 257, 2, 2, 128)])
def test_forward_backward_replays_match_eager(causal, deterministic, shape):
    stream = cupy.cuda.Stream(non_blocking=True)
    gen = cupy.random.default_rng(sum(shape) + 2 * causal + deterministic)
    with stream:
        q, k, v, dout = buffers(*shape)
        fill(gen, q, k, v, dout)
        out = cupy.empty_like(q)
        lse = cupy.empty((q.shape[0], q.shape[2], q.shape[1]), cupy.float32)
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        workspace = cuflash.backward_workspace(q, k, v, causal=causal, deterministic=deterministic)

        def step():
            cuflash.attention(q, k, v, causal=causal, out=out, lse=lse)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                       dq=dq, dk=dk, dv=dv, workspace=workspace)

        step()  # compiles, plans and sizes the stream's buffers before the capture
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(REPLAYS):
            fill(gen, q, k, v, dout)
            for x in (out, lse, dq, dk, dv):
                x.fill(np.nan)
            graph.launch(stream)
            e_out, e_lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            e_dq, e_dk, e_dv = cuflash.attention_backward(dout, q, k, v, e_out, e_lse, causal=causal,
                                                          deterministic=deterministic)
            for got, want in ((out, e_out), (lse, e_lse), (dk, e_dk), (dv, e_dv)):
                assert cupy.array_equal(got, want)
            if deterministic:
                assert cupy.array_equal(dq, e_dq)
            else:  # dq sums partial products with atomics: bits vary with their order
                assert not bool(cupy.isnan(dq).any())
                np.testing.assert_allclose(dq.get().astype(np.float32), e_dq.get().astype(np.float32),
                                           rtol=1e-2, atol=2e-3)
        stream.synchronize()


def test_capture_without_outputs_raises():
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v, dout = buffers(1, 64, 64, 2, 2, 64)
        fill(cupy.random.default_rng(0), q, k, v, dout)
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        grads = dict(dq=cupy.empty_like(q), dk=cupy.empty_like(k), dv=cupy.empty_like(v))
        # Both calls run once first, so that their kernels are compiled in this process (else the
        # capture's first error is the compile's, whichever tests ran before in it).
        cuflash.attention_backward(dout, q, k, v, out, lse, **grads)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="CUDA graph"):
                cuflash.attention(q, k, v)
            with pytest.raises(RuntimeError, match="workspace"):
                cuflash.attention_backward(dout, q, k, v, out, lse, **grads)
        finally:
            stream.end_capture()


def test_capture_of_a_first_compile_raises(monkeypatch):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v, _ = buffers(1, 64, 64, 2, 2, 64)
        out, lse = cupy.empty_like(q), cupy.empty((1, 2, 64), cupy.float32)
        monkeypatch.setattr(cf_compile, "_functions", {})  # as if nothing were compiled yet
        monkeypatch.setattr(kernel_call, "_kernels", {})
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="not compiled yet"):
                cuflash.attention(q, k, v, out=out, lse=lse)
        finally:
            stream.end_capture()
