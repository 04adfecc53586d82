"""Unfused attention in CuPy: the naive baseline, and the correctness reference when torch is missing."""

from __future__ import annotations

import math

import cupy
import numpy

from .variants import NO_WINDOW, effective_window

# The fallback reference runs on one batch entry and this many heads
# (attention is independent per (batch, head)) to bound its memory.
REFERENCE_HEADS = 4

# cudaDataType values (library_types.h) for the dtypes the naive path takes.
_CUDA_DATA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0}


def _bmm(a, b, *, transpose_b=False, alpha=1.0):
    """alpha * a @ b (or a @ b^T) for C-contiguous (batch, M, K) stacks.

    Calls cublasGemmStridedBatchedEx with the operands' own dtype and float32
    accumulation. ``cupy.matmul`` is not used because for arrays of more than
    two dimensions it converts float16 operands to float32 and runs an fp32
    GEMM (no tensor cores, and fp32 copies of the N x N scores), which makes
    the baseline many times slower and larger than unfused attention is.
    """
    from cupy_backends.cuda.libs import cublas

    batch, m, k = a.shape
    n = b.shape[1] if transpose_b else b.shape[2]
    c = cupy.empty((batch, m, n), dtype=a.dtype)
    dtype = _CUDA_DATA_TYPE[a.dtype.name]
    one = numpy.array(alpha, dtype=numpy.float32)
    zero = numpy.array(0.0, dtype=numpy.float32)
    # cuBLAS is column-major: a row-major C = A @ B is the column-major
    # C^T = B^T @ A^T, so the operands are passed swapped.
    cublas.gemmStridedBatchedEx(
        cupy.cuda.device.get_cublas_handle(),
        cublas.CUBLAS_OP_T if transpose_b else cublas.CUBLAS_OP_N,
        cublas.CUBLAS_OP_N,
        n, m, k,
        one.ctypes.data,
        b.data.ptr, dtype, k if transpose_b else n, b.shape[1] * b.shape[2],
        a.data.ptr, dtype, k, m * k,
        zero.ctypes.data,
        c.data.ptr, dtype, n, m * n,
        batch, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
    )
    return c


def score_bias(nq, nk, causal, window=NO_WINDOW, alibi_slopes=None, dtype=cupy.float32):
    """The additive score bias in `dtype`: -inf where query i may not see key j, and with ALiBi
    -slope_h |i + Nk - Nq - j| elsewhere; (Nq, Nk), or (H, Nq, Nk) with slopes; None if there is none."""
    row = cupy.arange(nq)[:, None]
    col = cupy.arange(nk)[None, :]
    if window == NO_WINDOW and alibi_slopes is None:
        return cupy.where(col > row + (nk - nq), -numpy.inf, 0.0).astype(dtype) if causal else None
    left, right = effective_window(window, causal)
    offset = col - row - (nk - nq)  # j - (i + Nk - Nq): 0 on the bottom-right diagonal
    visible = cupy.ones((nq, nk), dtype=bool)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    bias = cupy.where(visible, 0.0, -numpy.inf).astype(cupy.float32)
    if alibi_slopes is not None:
        bias = bias - cupy.asarray(alibi_slopes, dtype=cupy.float32)[:, None, None] * cupy.abs(offset)
    return bias.astype(dtype)


def _soft_cap(scores, softcap: float) -> None:
    """scores <- softcap * tanh(scores / softcap), in place."""
    scores /= softcap
    cupy.tanh(scores, out=scores)
    scores *= softcap


def naive_attention(q, k, v, causal: bool, dtype=None, window=NO_WINDOW, softcap=0.0, alibi_slopes=None):
    """softmax(Q K^T / sqrt(D)) V with the N x N scores materialised.

    The unfused baseline: one batched GEMM writes the scores, a row softmax
    runs over them, a second GEMM reads them. Computes in ``dtype`` (default:
    the input dtype) with float32 GEMM accumulation. The causal mask is aligned
    to the bottom-right corner, so query i (of Nq) sees keys j <= i + Nk - Nq,
    the convention FlashAttention uses. The softmax runs in place, so peak
    memory is one N x N buffer plus (B, H, N, D) copies of the inputs.
    window, softcap, alibi_slopes (H,): flash-attn's options (cuflash.bench.variants),
    the soft cap applied to the scaled scores before the ALiBi bias is added.
    """
    dtype = q.dtype if dtype is None else numpy.dtype(dtype)
    batch, nq, heads, d = q.shape
    nk = k.shape[1]

    def heads_major(x):  # (B, N, H, D) -> contiguous (B*H, N, D)
        return cupy.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(dtype, copy=False)).reshape(
            batch * heads, x.shape[1], d)

    s = _bmm(heads_major(q), heads_major(k), transpose_b=True, alpha=1.0 / math.sqrt(d))
    if softcap > 0:
        _soft_cap(s, softcap)
    bias = score_bias(nq, nk, causal, window, alibi_slopes, dtype)
    if bias is not None:
        # An additive (Nq, Nk) or (H, Nq, Nk) bias broadcasts in place over the batch.
        per_head = s.reshape(batch, heads, nq, nk)
        per_head += bias
    rows = s.reshape(-1, nk)  # 2-D view: cheaper indexing for the row ops
    rows -= rows.max(axis=1, keepdims=True)
    cupy.exp(rows, out=rows)
    rows /= rows.sum(axis=1, keepdims=True)
    out = _bmm(s, heads_major(v))  # (B*H, Nq, D)
    return out.reshape(batch, heads, nq, d).transpose(0, 2, 1, 3)  # (B, Nq, H, D)


def naive_attention_backward(dout, q, k, v, causal: bool, window=NO_WINDOW, softcap=0.0, alibi_slopes=None):
    """float32 gradients (dq, dk, dv) of softmax(Q K^T / sqrt(D)) V, N x N per head.

    The fallback correctness reference when torch is missing, and the only one
    with the options: one (batch, head) at a time, so memory stays at a few
    N x N float32 matrices. Same mask, options and bottom-right causal
    alignment as :func:`naive_attention`; equal head counts.
    """
    batch, nq, heads, d = q.shape
    nk = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    bias = score_bias(nq, nk, causal, window, alibi_slopes, cupy.float32)
    dq, dk, dv = (cupy.empty(x.shape, cupy.float32) for x in (q, k, v))
    for b in range(batch):
        for h in range(heads):
            qh, kh, vh, doh = (cupy.ascontiguousarray(x[b, :, h], dtype=cupy.float32)
                               for x in (q, k, v, dout))
            p = qh @ kh.T
            p *= scale
            if softcap > 0:
                _soft_cap(p, softcap)
                cap_grad = 1 - (p / softcap) ** 2  # d(c tanh(x / c)) / dx
            if bias is not None:
                p += bias[h] if bias.ndim == 3 else bias
            p -= p.max(axis=1, keepdims=True)
            cupy.exp(p, out=p)
            p /= p.sum(axis=1, keepdims=True)
            delta = (doh * (p @ vh)).sum(axis=1, keepdims=True)  # rowsum(dO o O)
            dv[b, :, h] = p.T @ doh
            ds = doh @ vh.T  # dP
            ds -= delta
            ds *= p
            del p
            if softcap > 0:
                ds *= cap_grad
                del cap_grad
            dq[b, :, h] = (ds @ kh) * scale
            dk[b, :, h] = (ds.T @ qh) * scale
            del ds
    return dq, dk, dv
