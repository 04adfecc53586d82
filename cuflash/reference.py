"""CPU reference implementations of attention, used as test oracles.

Layout everywhere: q is (batch, seqlen_q, nheads, headdim); k and v are
(batch, seqlen_k, nheads_kv, headdim).  Query head h reads kv head
h // (nheads // nheads_kv) (grouped-query attention).

    S = softmax_scale * q @ k^T          (masked entries set to -inf)
    lse = log(sum_j exp(S[:, j]))        (natural log, per query row)
    out = exp(S - lse) @ v

With causal=True the mask is aligned to the bottom-right corner of S: query
i sees key j iff j <= i + seqlen_k - seqlen_q.  When seqlen_q > seqlen_k the
first seqlen_q - seqlen_k rows see no key at all; such rows get out = 0 and
lse = -inf.
"""

import math

import ml_dtypes  # noqa: F401  (registers the "bfloat16" NumPy dtype)
import numpy as np


def causal_mask(seqlen_q, seqlen_k):
    """Boolean (seqlen_q, seqlen_k) matrix, True where query i may see key j."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + seqlen_k - seqlen_q


def _heads(q, k, v, causal, softmax_scale):
    """Yield (batch, head, q rows, k rows, v rows), the scale and the mask."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be divisible by nheads_kv ({nheads_kv})")
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    mask = causal_mask(seqlen_q, seqlen_k) if causal else None
    for b in range(batch):
        for h in range(nheads):
            yield b, h, q[b, :, h], k[b, :, h // group], v[b, :, h // group], scale, mask


def _softmax_rows(s):
    """Row softmax and log-sum-exp of s, which may hold -inf.

    Rows that are entirely -inf give probabilities 0 and lse -inf instead of
    the NaN that exp(-inf - -inf) would produce.
    """
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(s - row_max)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + row_max
    p = e / np.where(total > 0, total, 1.0)
    return p, lse[:, 0]


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """Exact attention in float64.

    Returns out (float64, shaped like q) and, with return_lse=True, also
    lse (float64, (batch, nheads, seqlen_q)).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
    for b, h, qh, kh, vh, scale, mask in _heads(q, k, v, causal, softmax_scale):
        s = scale * (qh @ kh.T)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        p, lse[b, h] = _softmax_rows(s)
        out[b, :, h] = p @ vh
    return (out, lse) if return_lse else out


def attention_naive_lowp(q, k, v, *, causal=False, softmax_scale=None, dtype):
    """Attention computed the naive way in a low-precision dtype.

    Mimics what a GPU framework does with three kernels in float16/bfloat16:
    scale q in dtype, S = q @ k^T with float32 accumulation rounded to dtype,
    softmax in float32 rounded to dtype, P @ V with float32 accumulation
    rounded to dtype.  Its error against `attention` is the yardstick for
    the "at most twice the naive error" accuracy rule.

    Returns a float32 array (whose values are all representable in dtype).
    """
    dtype = np.dtype(dtype)

    def rnd(x):
        return np.asarray(x).astype(dtype).astype(np.float32)

    q, k, v = rnd(q), rnd(k), rnd(v)
    out = np.zeros(q.shape, dtype=np.float32)
    for b, h, qh, kh, vh, scale, mask in _heads(q, k, v, causal, softmax_scale):
        s = rnd(rnd(qh * np.float32(scale)) @ kh.T)
        if mask is not None:
            s = np.where(mask, s, np.float32(-np.inf))
        p, _ = _softmax_rows(s)
        out[b, :, h] = rnd(rnd(p) @ vh)
    return out
