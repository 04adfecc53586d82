"""Launch plans of repeated backward calls: a planned call (validation and dispatch skipped) gives the
bits of a full-path call; other signatures get plans of their own; bad arguments still raise."""

import cupy
import numpy as np
import pytest

import cuflash
from cuflash import backward, dispatch, validate
from tests.numerics import randn

pytestmark = pytest.mark.gpu


def inputs(gen, batch, nq, nk, nheads, nheads_kv, headdim, dtype=cupy.float16):
    q_shape, kv_shape = (batch, nq, nheads, headdim), (batch, nk, nheads_kv, headdim)
    q, dout = randn(gen, q_shape, dtype), randn(gen, q_shape, dtype)
    k, v = randn(gen, kv_shape, dtype), randn(gen, kv_shape, dtype)
    return dout, q, k, v


def grads(dout, q, k, v, **options):
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=options.get("causal", False))
    return cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)


def same_bits(a, b):
    return all(bool(cupy.array_equal(x, y)) for x, y in zip(a, b))


def test_repeated_backward_calls_take_the_plan(monkeypatch):
    gen = cupy.random.default_rng(7)
    args = inputs(gen, 2, 97, 130, 4, 2, 64)
    first = grads(*args)
    assert len(backward._plans) == 1
    causal = grads(*args, causal=True)
    wide = inputs(gen, 2, 97, 130, 8, 4, 64)
    view = tuple(x[:, :, ::2] for x in wide)  # strided heads
    strided = grads(*view)
    assert len(backward._plans) == 3
    with pytest.raises(TypeError, match="dout"):
        cuflash.attention_backward(args[0].astype(cupy.float32), *args[1:], *cuflash.attention(
            *args[1:], return_lse=True))

    def must_not_run(*a, **kw):
        raise AssertionError("a planned call validated or dispatched again")

    monkeypatch.setattr(validate, "qkv", must_not_run)
    monkeypatch.setattr(dispatch, "bwd_config", must_not_run)
    monkeypatch.setattr(dispatch, "fwd_config", must_not_run)
    assert same_bits(grads(*args), first)
    assert same_bits(grads(*args, causal=True), causal)
    assert same_bits(grads(*view), strided)
    # New contents under a planned signature: the planned call matches a fresh full-path call.
    fresh = inputs(gen, 2, 97, 130, 4, 2, 64)
    planned = grads(*fresh)
    monkeypatch.undo()
    backward._plans.clear()
    assert same_bits(grads(*fresh), planned)


def test_backward_with_given_outputs_and_workspace_reuses_them():
    gen = cupy.random.default_rng(8)
    dout, q, k, v = inputs(gen, 1, 257, 257, 2, 2, 128)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = (cupy.full_like(x, np.nan) for x in (q, k, v))
    workspace = cuflash.backward_workspace(q, k, v)
    for _ in range(2):  # the second call takes the plan
        got = cuflash.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, workspace=workspace)
        assert got[0] is dq and got[1] is dk and got[2] is dv
        want = cuflash.attention_backward(dout, q, k, v, out, lse)
        assert same_bits(got[1:], want[1:])  # dq sums with atomics: its bits may differ
        np.testing.assert_allclose(dq.get().astype(np.float32), want[0].get().astype(np.float32), rtol=1e-2,
                                   atol=2e-3)


def test_a_too_small_workspace_raises():
    gen = cupy.random.default_rng(9)
    dout, q, k, v = inputs(gen, 1, 64, 64, 2, 2, 64)
    small = cuflash.backward_workspace(q, k, v)
    dout, q, k, v = inputs(gen, 2, 300, 300, 2, 2, 64)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="workspace"):
        cuflash.attention_backward(dout, q, k, v, out, lse, workspace=small)
