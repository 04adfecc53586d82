"""CPU reference implementations of attention, used as test oracles.

Layout everywhere: q is (batch, seqlen_q, nheads, headdim); k and v are
(batch, seqlen_k, nheads_kv, headdim).  Query head h reads kv head
h // (nheads // nheads_kv) (grouped-query attention).

    s = softmax_scale * q @ k^T
    s = softcap * tanh(s / softcap)      (softcap > 0 only)
    s = s - slope[b, h] * |i + seqlen_k - seqlen_q - j|   (alibi_slopes only)
    S = s with the entries query i may not see set to -inf
    lse = log(sum_j exp(S[:, j]))        (natural log, per query row)
    out = exp(S - lse) @ v

Which keys query i sees (`visible_mask`), with d = i + seqlen_k - seqlen_q,
the key aligned with query i when the corners of S are bottom-right aligned,
and window_size = (left, right), -1 meaning unbounded:

    j >= d - left (left >= 0 only)  and  j <= d + right (right >= 0 only)

causal=True sets right = 0, whatever window_size says, and keeps its left.
When seqlen_q > seqlen_k + right the first rows see no key at all; such rows
get out = 0 and lse = -inf.

`attention_backward` gives the gradients (dq, dk, dv) of the same function,
through the tanh of softcap; alibi_slopes are constants without a gradient.
Rows that see no key contribute nothing to them (their dq is 0).

alibi_slopes: float32 values of shape (nheads,) or (batch, nheads), as a
NumPy array, anything np.asarray takes, or a CuPy array.

Dropout (flash-attn's semantics) is given as a keep mask: dropout_mask,
boolean (batch, nheads, seqlen_q, seqlen_k), True where P[i, j] is kept, and
dropout_p, the probability it was drawn with.  Then

    out = ((P * mask) / (1 - dropout_p)) @ v

while lse stays that of the softmax before dropout.  dropout_p > 0 without a
mask is an error (the reference draws no random numbers).

Variable-length batches (`attention_varlen`): q is (total_q, nheads,
headdim) and k, v (total_k, nheads_kv, headdim), the sequences packed one
after another; cu_seqlens_q and cu_seqlens_k (batch + 1,) hold their
offsets.  Sequence b is attention of q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]
on its own keys, with every option applied per sequence (the causal and
window diagonals bottom-right aligned in each, or top-left aligned with
mask_alignment="top_left"). seqused_q and seqused_k (batch,) keep only the
first rows of each sequence's spans; the rows past them are not attention's
(out 0, lse -inf, gradients 0).

mask_alignment, here and in `attention`: "bottom_right" (query i's diagonal
key is i + seqlen_k - seqlen_q, flash-attn's) or "top_left" (i, jax.nn's), for
the causal mask, the window and ALiBi's distance.
"""

import math
from typing import NamedTuple

import ml_dtypes  # noqa: F401  (registers the "bfloat16" NumPy dtype)
import numpy as np

from .score_mods import DROPOUT_DRAW_BITS, Dropout, queries_rotate_apart


def _diagonal(seqlen_q, seqlen_k, mask_alignment):
    """Each query's diagonal key, a (seqlen_q, 1) column (mask_alignment: the module docstring's)."""
    if mask_alignment not in ("bottom_right", "top_left"):
        raise ValueError(f"mask_alignment must be 'bottom_right' or 'top_left', got {mask_alignment!r}")
    return np.arange(seqlen_q)[:, None] + (0 if mask_alignment == "top_left" else seqlen_k - seqlen_q)


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), mask_alignment="bottom_right"):
    """Boolean (seqlen_q, seqlen_k) matrix, True where query i may see key j."""
    left, right = (int(x) for x in window_size)
    if causal:
        right = 0
    diagonal = _diagonal(seqlen_q, seqlen_k, mask_alignment)
    j = np.arange(seqlen_k)[None, :]
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        mask &= j >= diagonal - left
    if right >= 0:
        mask &= j <= diagonal + right
    return mask


def causal_mask(seqlen_q, seqlen_k):
    """Boolean (seqlen_q, seqlen_k) matrix, True where query i may see key j <= i + seqlen_k - seqlen_q."""
    return visible_mask(seqlen_q, seqlen_k, causal=True)


def _host_slopes(alibi_slopes, batch, nheads):
    """alibi_slopes as a float64 (batch, nheads) NumPy array, or None."""
    if alibi_slopes is None:
        return None
    if hasattr(alibi_slopes, "get"):
        alibi_slopes = alibi_slopes.get()
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    if slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                         f"{(batch, nheads)}, got {slopes.shape}")
    return np.broadcast_to(slopes, (batch, nheads))


class _ScoreMods(NamedTuple):
    """What turns q @ k^T into the masked scores S of one call."""

    scale: float
    softcap: float
    mask: np.ndarray  # (seqlen_q, seqlen_k) bool, True where visible
    slopes: np.ndarray | None  # (batch, nheads) float64
    distance: np.ndarray  # (seqlen_q, seqlen_k) |query i's diagonal key - j|

    def modify(self, s, b, h, rnd=None):
        """Softcap, ALiBi bias and mask applied to the scaled scores s of (batch b, head h).

        Computes in s's dtype; rnd, when given, rounds each step's result as a
        framework working in a low-precision dtype would.  Returns the masked
        scores and tanh(s / softcap) (None without softcap), which the
        backward needs.
        """
        rnd = rnd or (lambda x: x)
        real = s.dtype.type
        tanh = None
        if self.softcap > 0:
            tanh = np.tanh(s / real(self.softcap))
            s = rnd(real(self.softcap) * tanh)
        if self.slopes is not None:
            s = rnd(s - (self.slopes[b, h] * self.distance).astype(s.dtype))
        return np.where(self.mask, s, real(-np.inf)), tanh


def _heads(q, k, v, softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
           mask_alignment="bottom_right"):
    """The score modifications of the call and, per (batch, head), (b, h, q rows, k rows, v rows)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be divisible by nheads_kv ({nheads_kv})")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    diagonal = _diagonal(seqlen_q, seqlen_k, mask_alignment)
    mods = _ScoreMods(scale, float(softcap), visible_mask(seqlen_q, seqlen_k, causal, window_size, mask_alignment),
                      _host_slopes(alibi_slopes, batch, nheads),
                      np.abs(diagonal - np.arange(seqlen_k)[None, :]).astype(np.float64))
    heads = ((b, h, q[b, :, h], k[b, :, h // group], v[b, :, h // group])
             for b in range(batch) for h in range(nheads))
    return mods, heads


def _dropout_keep(dropout_mask, dropout_p, batch, nheads, seqlen_q, seqlen_k):
    """(mask, 1 / (1 - dropout_p)) of a call, mask a (batch, nheads, seqlen_q, seqlen_k) bool
    NumPy array; (None, 1.0) without dropout."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_mask is None:
        if p > 0:
            raise ValueError("dropout_p > 0 needs a dropout_mask (the reference draws no random numbers)")
        return None, 1.0
    if hasattr(dropout_mask, "get"):
        dropout_mask = dropout_mask.get()
    mask = np.asarray(dropout_mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"dropout_mask must be boolean (True: kept), got {mask.dtype}")
    shape = (batch, nheads, seqlen_q, seqlen_k)
    if mask.shape != shape:
        raise ValueError(f"dropout_mask must have shape (batch, nheads, seqlen_q, seqlen_k) = {shape}, "
                         f"got {mask.shape}")
    return mask, 1.0 / (1.0 - p)


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


def attention(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              softmax_scale=None, return_lse=False, dropout_mask=None, dropout_p=0.0, mask_alignment="bottom_right"):
    """Exact attention in float64, with the options of the module docstring.

    Returns out (float64, shaped like q) and, with return_lse=True, also
    lse (float64, (batch, nheads, seqlen_q)), that of the undropped softmax.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
    mods, heads = _heads(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, mask_alignment)
    keep, rescale = _dropout_keep(dropout_mask, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for b, h, qh, kh, vh in heads:
        s, _ = mods.modify(mods.scale * (qh @ kh.T), b, h)
        p, lse[b, h] = _softmax_rows(s)
        if keep is not None:
            p = np.where(keep[b, h], p * rescale, 0.0)
        out[b, :, h] = p @ vh
    return (out, lse) if return_lse else out


def attention_probs(q, k, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    softmax_scale=None):
    """The softmax P of `attention` (before dropout) in float64: (batch, nheads, seqlen_q, seqlen_k), 0
    where a key is not visible and in rows that see no key."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    probs = np.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    mods, heads = _heads(q, k, k, softmax_scale, causal, window_size, softcap, alibi_slopes)  # no v: k stands in
    for b, h, qh, kh, _ in heads:
        s, _ = mods.modify(mods.scale * (qh @ kh.T), b, h)
        probs[b, h], _ = _softmax_rows(s)
    return probs


def _rounder(dtype):
    """x -> x rounded to dtype, as float32."""
    dtype = np.dtype(dtype)
    return lambda x: np.asarray(x).astype(dtype).astype(np.float32)


def attention_naive_lowp(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         softmax_scale=None, dtype, dropout_mask=None, dropout_p=0.0, mask_alignment="bottom_right"):
    """Attention computed the naive way in a low-precision dtype.

    Mimics what a GPU framework does with a kernel per step in
    float16/bfloat16: scale q in dtype, S = q @ k^T with float32 accumulation
    rounded to dtype, softcap * tanh(S / softcap) in float32 from the rounded
    S and rounded, the ALiBi bias added in float32 and rounded, softmax in
    float32 rounded to dtype, P @ V with float32 accumulation rounded to
    dtype.  Its error against `attention` is the yardstick for the "at most
    twice the naive error" accuracy rule.  With a dropout_mask the rounded P
    is multiplied by mask / (1 - dropout_p) in float32 and rounded again
    before P @ V.

    Returns a float32 array (whose values are all representable in dtype).
    """
    rnd = _rounder(dtype)
    q, k, v = rnd(q), rnd(k), rnd(v)
    out = np.zeros(q.shape, dtype=np.float32)
    mods, heads = _heads(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, mask_alignment)
    keep, rescale = _dropout_keep(dropout_mask, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for b, h, qh, kh, vh in heads:
        s, _ = mods.modify(rnd(rnd(qh * np.float32(mods.scale)) @ kh.T), b, h, rnd)
        p, _ = _softmax_rows(s)
        p = rnd(p)
        if keep is not None:
            p = rnd(np.where(keep[b, h], p * np.float32(rescale), np.float32(0)))
        out[b, :, h] = rnd(p @ vh)
    return out


def fp8_quantize(x, per_axes=(1, 3)):
    """Symmetric e4m3 quantisation of a float array with one scale per remaining axis.

    x: (batch, seqlen, heads, headdim). Returns (bits as uint8, descale float32 of
    shape (batch, heads)) with x ~ e4m3(bits) * descale; amax maps to 448.
    """
    amax = np.abs(np.asarray(x, dtype=np.float64)).max(axis=per_axes)
    descale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    scaled = np.asarray(x, dtype=np.float64) / descale[:, None, :, None]
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), descale


def fp8_dequantize(bits, descale):
    """float64 values of e4m3 `bits` (batch, seqlen, heads, headdim) times descale (batch, heads)."""
    values = np.asarray(bits).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.asarray(descale, dtype=np.float64)[:, None, :, None]


def attention_naive_fp8(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    """Attention on fp8 operands computed the straightforward way with fp8 GEMMs.

    q, k, v: the dequantised float values (exactly representable as e4m3 times
    their descale). S = q k^T in float32, softcapped in float32; P = exp(S - row
    max) in float32, rounded to e4m3 (the operand of an fp8 P V GEMM); out =
    (P V) / rowsum(P) in float32, rounded to bfloat16, the output dtype. The
    yardstick of the fp8 accuracy rule.
    """
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    out = np.zeros(q.shape, dtype=np.float32)
    mods, heads = _heads(q, k, v, softmax_scale, causal, window_size, softcap)
    for b, h, qh, kh, vh in heads:
        s, _ = mods.modify(np.float32(mods.scale) * (qh @ kh.T), b, h)
        row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0).astype(np.float32)
        e = np.exp(s - row_max)
        total = e.sum(axis=-1, keepdims=True)
        pv = e.astype(e4m3).astype(np.float32) @ vh
        out[b, :, h] = np.where(total > 0, pv / np.where(total > 0, total, 1.0), 0.0)
    return out.astype(ml_dtypes.bfloat16).astype(np.float32)


def attention_backward(dout, q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       softmax_scale=None, dropout_mask=None, dropout_p=0.0, mask_alignment="bottom_right"):
    """Gradients of attention in float64, from the closed form.

    For a loss L with dL/dout = dout, per batch and query head, with S the
    masked scores of the module docstring:

        P  = softmax(S)                 (rows that see no key: P = 0)
        dV = P^T dO
        dP = dO V^T
        dS = P * (dP - rowsum(dP * P))  (rowsum(dP * P) = rowsum(dO * out))
        dS = dS * (1 - tanh^2(s / softcap))   (softcap > 0 only; s the scaled score)
        dQ = softmax_scale * dS K
        dK = softmax_scale * dS^T Q

    With dropout (keep mask M, Z = M / (1 - dropout_p)) the function is
    out = (P * Z) V, and

        dV = (P * Z)^T dO
        dP = (dO V^T) * Z
        dS = P * (dP - rowsum(dO * out))   (rowsum(dO * out) = rowsum(dP * P))

    With grouped-query attention dK and dV of a kv head are summed over the
    query heads that read it.  Returns (dq, dk, dv), float64, shaped like
    (q, k, v).
    """
    dout, q, k, v = (np.asarray(x, dtype=np.float64) for x in (dout, q, k, v))
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    group = q.shape[2] // k.shape[2]
    dq = np.zeros(q.shape, dtype=np.float64)
    dk = np.zeros(k.shape, dtype=np.float64)
    dv = np.zeros(v.shape, dtype=np.float64)
    mods, heads = _heads(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, mask_alignment)
    keep, rescale = _dropout_keep(dropout_mask, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for b, h, qh, kh, vh in heads:
        s, tanh = mods.modify(mods.scale * (qh @ kh.T), b, h)
        p, _ = _softmax_rows(s)
        doh = dout[b, :, h]
        dp = doh @ vh.T
        p_used = p
        if keep is not None:
            p_used = np.where(keep[b, h], p * rescale, 0.0)
            dp = np.where(keep[b, h], dp * rescale, 0.0)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq[b, :, h] = mods.scale * (ds @ kh)
        dk[b, :, h // group] += mods.scale * (ds.T @ qh)
        dv[b, :, h // group] += p_used.T @ doh
    return dq, dk, dv


def attention_backward_naive_lowp(dout, q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0,
                                  alibi_slopes=None, softmax_scale=None, dtype, dropout_mask=None,
                                  dropout_p=0.0, mask_alignment="bottom_right"):
    """Gradients of attention computed the naive way in a low-precision dtype.

    What reverse-mode autodiff through `attention_naive_lowp` does in
    float16/bfloat16: every matmul accumulates in float32 and rounds to
    dtype, the softmax backward runs in float32 from the rounded P and dP and
    rounds to dtype, the tanh of softcap multiplies the rounded dS by
    (1 - tanh^2) in float32 and rounds, and the scaling of q is
    differentiated as its own step (dq = round(round(dS K) * scale),
    dk = round(dS^T round(q * scale))).  The kv gradients of a grouped-query
    head group are summed in float32 and rounded once.  With a dropout_mask
    the dropped P (as in the forward) gives dV, and the rounded dO V^T is
    multiplied by mask / (1 - dropout_p) in float32 and rounded before the
    softmax backward.  The softmax backward's row term rowsum(dP * P) is
    taken as rowsum(dO * out) in float32 with out the forward's output
    rounded to dtype: the backward's inputs hold out, not P, so every
    implementation of it starts from the rounded out (with dropout, or a
    single key, that rounding is the whole error of dQ and dK).  Its error
    against `attention_backward` is the yardstick for the "at most twice the
    naive error" accuracy rule.

    Returns (dq, dk, dv), float32 arrays whose values are all representable
    in dtype.
    """
    rnd = _rounder(dtype)
    dout, q, k, v = rnd(dout), rnd(q), rnd(k), rnd(v)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    group = q.shape[2] // k.shape[2]
    dq = np.zeros(q.shape, dtype=np.float32)
    dk = np.zeros(k.shape, dtype=np.float32)
    dv = np.zeros(v.shape, dtype=np.float32)
    mods, heads = _heads(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, mask_alignment)
    scale = np.float32(mods.scale)
    keep, rescale = _dropout_keep(dropout_mask, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for b, h, qh, kh, vh in heads:
        qs = rnd(qh * scale)
        s, tanh = mods.modify(rnd(qs @ kh.T), b, h, rnd)
        p, _ = _softmax_rows(s)
        p = rnd(p)
        doh = dout[b, :, h]
        dp = rnd(doh @ vh.T)
        p_used = p
        if keep is not None:
            p_used = rnd(np.where(keep[b, h], p * np.float32(rescale), np.float32(0)))
            dp = rnd(np.where(keep[b, h], dp * np.float32(rescale), np.float32(0)))
        out = rnd(p_used @ vh)
        ds = rnd(p * (dp - (doh * out).sum(axis=-1, keepdims=True)))
        if tanh is not None:
            ds = rnd(ds * (1 - tanh * tanh))
        dq[b, :, h] = rnd(rnd(ds @ kh) * scale)
        dk[b, :, h // group] += rnd(ds.T @ qs)
        dv[b, :, h // group] += rnd(p_used.T @ doh)
    return dq, rnd(dk), rnd(dv)


# --- Variable-length batches -----------------------------------------------


def _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_mask, seqused=(None, None)):
    """Per sequence b: (rows of q, rows of k, per-sequence options) of a varlen call.

    seqused: (seqused_q, seqused_k), each None or (batch,): the rows kept of each span.

    The options are alibi_slopes (nheads,) of sequence b, or None, and
    dropout_mask (nheads, seqlen_q_b, seqlen_k_b) of sequence b wrapped to
    batch 1, or None: a varlen dropout_mask is padded, (batch, nheads,
    max_seqlen_q, max_seqlen_k) with any max_seqlen at least the longest
    sequence, and sequence b reads its top-left corner.
    """
    cu_q, cu_k = (np.asarray(c.get() if hasattr(c, "get") else c) for c in (cu_seqlens_q, cu_seqlens_k))
    for name, cu, x in (("cu_seqlens_q", cu_q, q), ("cu_seqlens_k", cu_k, k)):
        if cu.ndim != 1 or cu.shape[0] < 2 or not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array of shape (batch + 1,), got {cu.dtype} {cu.shape}")
        if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != x.shape[0]:
            raise ValueError(f"{name} must start at 0, not decrease and end at {x.shape[0]}, got {cu.tolist()}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same shape, got {cu_q.shape} and {cu_k.shape}")
    batch, nheads = cu_q.shape[0] - 1, q.shape[1]
    slopes = _host_slopes(alibi_slopes, batch, nheads)
    mask = None
    if dropout_mask is not None:
        mask = np.asarray(dropout_mask.get() if hasattr(dropout_mask, "get") else dropout_mask)
        longest = (int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))
        if mask.ndim != 4 or mask.shape[:2] != (batch, nheads) or mask.shape[2] < longest[0] \
                or mask.shape[3] < longest[1]:
            raise ValueError(f"dropout_mask must have shape (batch, nheads, >= max seqlen_q, >= max seqlen_k) = "
                             f"({batch}, {nheads}, >= {longest[0]}, >= {longest[1]}), got {mask.shape}")
    used = []
    for name, x, cu in (("seqused_q", seqused[0], cu_q), ("seqused_k", seqused[1], cu_k)):
        spans = np.diff(cu)
        x = spans if x is None else np.asarray(x.get() if hasattr(x, "get") else x)
        if x.shape != (batch,) or np.any(x < 0) or np.any(x > spans):
            raise ValueError(f"{name} must have shape ({batch},) and values in [0, each span's length], got {x}")
        used.append(x)
    for b in range(batch):
        rows_q = slice(int(cu_q[b]), int(cu_q[b] + used[0][b]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b] + used[1][b]))
        seq_mask = None
        if mask is not None:
            seq_mask = mask[b : b + 1, :, : rows_q.stop - rows_q.start, : rows_k.stop - rows_k.start]
        yield rows_q, rows_k, dict(alibi_slopes=None if slopes is None else slopes[b], dropout_mask=seq_mask)


def _check_varlen(q, k, v, dout=None):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims (total, nheads, headdim), got shape {x.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
    if dout is not None and dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, softmax_scale=None, return_lse=False, dropout_mask=None, dropout_p=0.0,
                     seqused_q=None, seqused_k=None, mask_alignment="bottom_right"):
    """Exact attention of a variable-length batch in float64 (`attention` per sequence).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim);
    cu_seqlens_q, cu_seqlens_k: (batch + 1,) offsets of the sequences, which
    may be empty.  alibi_slopes: (nheads,) or (batch, nheads), row b for
    sequence b.  dropout_mask: (batch, nheads, max_seqlen_q, max_seqlen_k),
    sequence b using mask[b, :, :seqlen_q_b, :seqlen_k_b].

    Returns out (float64, (total_q, nheads, headdim)) and, with
    return_lse=True, also lse (float64, (nheads, total_q)), flash-attn's
    varlen layout.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    _check_varlen(q, k, v)
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for rows_q, rows_k, per_seq in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                     dropout_mask, (seqused_q, seqused_k)):
        o, l = attention(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal, window_size=window_size,
                         softcap=softcap, softmax_scale=softmax_scale, return_lse=True, dropout_p=dropout_p,
                         mask_alignment=mask_alignment, **per_seq)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, softmax_scale=None, dropout_mask=None, dropout_p=0.0,
                              seqused_q=None, seqused_k=None, mask_alignment="bottom_right"):
    """Gradients (dq, dk, dv) of `attention_varlen` in float64 (`attention_backward` per sequence)."""
    dout, q, k, v = (np.asarray(x, dtype=np.float64) for x in (dout, q, k, v))
    _check_varlen(q, k, v, dout)
    dq, dk, dv = (np.zeros(x.shape, dtype=np.float64) for x in (q, k, v))
    for rows_q, rows_k, per_seq in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                     dropout_mask, (seqused_q, seqused_k)):
        grads = attention_backward(dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                   causal=causal, window_size=window_size, softcap=softcap,
                                   softmax_scale=softmax_scale, dropout_p=dropout_p, mask_alignment=mask_alignment,
                                   **per_seq)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in grads)
    return dq, dk, dv


def attention_varlen_naive_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, softmax_scale=None, dtype, dropout_mask=None,
                                dropout_p=0.0, seqused_q=None, seqused_k=None, mask_alignment="bottom_right"):
    """`attention_naive_lowp` per sequence of a variable-length batch; float32 (total_q, nheads, headdim)."""
    rnd = _rounder(dtype)
    q, k, v = rnd(q), rnd(k), rnd(v)
    _check_varlen(q, k, v)
    out = np.zeros(q.shape, dtype=np.float32)
    for rows_q, rows_k, per_seq in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                     dropout_mask, (seqused_q, seqused_k)):
        out[rows_q] = attention_naive_lowp(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal,
                                           window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
                                           dtype=dtype, dropout_p=dropout_p, mask_alignment=mask_alignment,
                                           **per_seq)[0]
    return out


def attention_varlen_backward_naive_lowp(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None,
                                         dtype, dropout_mask=None, dropout_p=0.0, seqused_q=None, seqused_k=None,
                                         mask_alignment="bottom_right"):
    """`attention_backward_naive_lowp` per sequence of a variable-length batch; float32 (dq, dk, dv)."""
    rnd = _rounder(dtype)
    dout, q, k, v = rnd(dout), rnd(q), rnd(k), rnd(v)
    _check_varlen(q, k, v, dout)
    dq, dk, dv = (np.zeros(x.shape, dtype=np.float32) for x in (q, k, v))
    for rows_q, rows_k, per_seq in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                     dropout_mask, (seqused_q, seqused_k)):
        grads = attention_backward_naive_lowp(dout[None, rows_q], q[None, rows_q], k[None, rows_k],
                                              v[None, rows_k], causal=causal, window_size=window_size,
                                              softcap=softcap, softmax_scale=softmax_scale, dtype=dtype,
                                              dropout_p=dropout_p, mask_alignment=mask_alignment, **per_seq)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in grads)
    return dq, dk, dv


# ---------------------------------------------------------------- KV cache

def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary embedding of x (seqlen, nheads, headdim) at `positions` (seqlen,), in float64.

    cos, sin: (rows, rotary_dim / 2). interleaved: pairs (x[2p], x[2p + 1]) turn by the
    angle of column p; else pairs (x[p], x[p + rotary_dim / 2]). Columns past rotary_dim stay.
    """
    x = np.array(x, dtype=np.float64)
    cos = np.asarray(cos, dtype=np.float64)[positions][:, None, :]
    sin = np.asarray(sin, dtype=np.float64)[positions][:, None, :]
    half = cos.shape[-1]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = a * cos - b * sin, a * sin + b * cos
    return x


def _host(x):
    return None if x is None else np.asarray(x.get() if hasattr(x, "get") else x)


def kvcache_quantize(x, descale):
    """New keys or values x (n, nheads_kv, headdim) in q's dtype as an fp8 cache stores them: e4m3
    bits of float32(x) / descale (nheads_kv,), rounded to nearest even, saturated at +-448."""
    scaled = np.asarray(x, np.float32) / np.asarray(descale, np.float32)[None, :, None]
    return np.clip(scaled, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _kvcache_capacity(k_cache, block_table):
    """Positions a batch's cache holds: its rows, or max_pages * page_size."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def kvcache_sequences(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                      cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                      rotary_interleaved=True, alibi_slopes=None, k_descale=None, v_descale=None,
                      rotate_apart=True):
    """The append of `attention_with_kvcache` and what each batch then attends.

    Returns (k_cache_after, v_cache_after, sequences): the caches after the call,
    copies in the caches' dtype with the new keys (rotated in float64, then
    rounded) and values written at positions cache_seqlens[b] ...; and per batch
    (q rotated at positions cache_seqlens[b] + i, or every row at cache_seqlens[b] where not
    rotate_apart (`score_mods.queries_rotate_apart`), in float64 then rounded to q's dtype as
    flash-attn's reference does, as float64; keys and values at
    positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new) in the cache's
    dtype, (1, nheads) ALiBi slopes or None). A paged cache is (num_pages,
    page_size, nheads_kv, headdim) with block_table (batch, max_pages).
    An fp8 cache (uint8 e4m3 bits) stores new keys and values as `kvcache_quantize` does
    (keys rotated and rounded to q's dtype first); its keys and values attend as float64
    e4m3 * k_descale[b] (v_descale[b]), descales float32 (batch, nheads_kv), None meaning 1.
    """
    q, k_cache, v_cache, k, v = (_host(x) for x in (q, k_cache, v_cache, k, v))
    fp8 = k_cache.dtype == np.uint8
    batch, nheads_kv = q.shape[0], k_cache.shape[2]
    k_descale, v_descale = (np.ones((batch, nheads_kv), np.float32) if x is None else _host(x)
                            for x in (k_descale, v_descale))
    cache_batch_idx, cache_leftpad, block_table = (_host(x) for x in (cache_batch_idx, cache_leftpad, block_table))
    rotary_cos, rotary_sin, alibi_slopes = (_host(x) for x in (rotary_cos, rotary_sin, alibi_slopes))
    batch, seqlen_q, nheads, headdim = q.shape
    n_new = 0 if k is None else k.shape[1]
    k_after, v_after = k_cache.copy(), v_cache.copy()
    page_size = k_cache.shape[1]
    capacity = _kvcache_capacity(k_cache, block_table)
    if cache_seqlens is None:
        lengths = np.full(batch, capacity - n_new)
    else:
        lengths = np.broadcast_to(np.asarray(_host(cache_seqlens), dtype=np.int64), (batch,))
    sequences = []
    for b in range(batch):
        if block_table is not None:
            places = [(block_table[b][j // page_size], j % page_size) for j in range(capacity)]
        else:
            row = b if cache_batch_idx is None else cache_batch_idx[b]
            places = [(row, j) for j in range(capacity)]
        length = int(lengths[b])
        if n_new:
            new_k = k[b].astype(np.float64)
            if rotary_cos is not None:
                new_k = apply_rotary(new_k, rotary_cos, rotary_sin, length + np.arange(n_new), rotary_interleaved)
            if fp8:
                new_k = kvcache_quantize(new_k.astype(k.dtype), k_descale[b])
                new_v = kvcache_quantize(v[b], v_descale[b])
            else:
                new_k, new_v = new_k.astype(k_cache.dtype), v[b]
            for t in range(n_new):
                unit, row = places[length + t]
                k_after[unit, row] = new_k[t]
                v_after[unit, row] = new_v[t]
        attended = places[0 if cache_leftpad is None else int(cache_leftpad[b]):length + n_new]
        keys = np.array([k_after[u, r] for u, r in attended], k_cache.dtype).reshape(-1, *k_cache.shape[2:])
        values = np.array([v_after[u, r] for u, r in attended], v_cache.dtype).reshape(-1, *v_cache.shape[2:])
        if fp8:
            keys = fp8_dequantize(keys[None], k_descale[b][None])[0]
            values = fp8_dequantize(values[None], v_descale[b][None])[0]
        qb = q[b].astype(np.float64)
        if rotary_cos is not None:  # rounded to q's dtype, as the new keys are in the cache
            positions = length + (np.arange(seqlen_q) if rotate_apart else np.zeros(seqlen_q, np.int64))
            qb = apply_rotary(qb, rotary_cos, rotary_sin, positions, rotary_interleaved)
            qb = qb.astype(q.dtype).astype(np.float64)
        slopes = None
        if alibi_slopes is not None:
            slopes = (alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b])[None]
        sequences.append((qb, keys, values, slopes))
    return k_after, v_after, sequences


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, softmax_scale=None, k_descale=None, v_descale=None, lowp_dtype=None):
    """`cuflash.attention_with_kvcache` in float64: (out, lse, k_cache_after, v_cache_after).

    The append and the attended keys are `kvcache_sequences`'; each batch is
    `attention` of its rotated q on its keys (seqlen_k = their count). With
    lowp_dtype, the naive computation in that dtype instead (q rounded to it after rotary).
    """
    k_after, v_after, sequences = kvcache_sequences(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale,
        rotate_apart=queries_rotate_apart(causal, window_size, _kvcache_capacity(k_cache, block_table)))
    batch, seqlen_q, nheads, _ = q.shape
    out = np.zeros(q.shape, np.float64)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    for b, (qb, keys, values, slopes) in enumerate(sequences):
        if keys.shape[0] == 0:
            continue
        if lowp_dtype is None:
            ob, lb = attention(qb[None], keys[None], values[None], alibi_slopes=slopes, return_lse=True, **options)
            lse[b] = lb[0]
        else:
            ob = attention_naive_lowp(qb[None], keys[None], values[None], alibi_slopes=slopes, dtype=lowp_dtype,
                                      **options)
        out[b] = ob[0]
    return out, lse, k_after, v_after


# ---------------------------------------------------------------- dropout

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 7  # cuda_src/dropout.cuh


def philox4x32(counter, key, rounds=PHILOX_ROUNDS):
    """Philox4x32 of uint32 arrays with `rounds` rounds: counter (4, ...) and key (2, ...); returns
    (4, ...) uint32."""
    c = [np.asarray(x, np.uint64) for x in counter]
    k = [np.asarray(x, np.uint64) for x in key]
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0 = c[0] * np.uint64(_PHILOX_M[0])
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k[1], p0 & mask]
        k = [(k[0] + np.uint64(_PHILOX_W[0])) & mask, (k[1] + np.uint64(_PHILOX_W[1])) & mask]
    return np.stack(c).astype(np.uint32)


def dropout_keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """The keep mask the kernels draw for dropout_p with (seed, offset): bool (batch, nheads, seqlen_q,
    seqlen_k), element (b, h, i, j) kept when its Philox4x32-7 draw (the low DROPOUT_DRAW_BITS bits of
    a 16-bit half of an output word) is below Dropout.threshold, round((1 - p) 2^DROPOUT_DRAW_BITS)
    (cuda_src/dropout.cuh: the unit of rows {r, r + 8} x columns {c, c + 1, c + 8, c + 9})."""
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q), np.arange(seqlen_k),
                             indexing="ij")
    dropout = Dropout(float(dropout_p), seed, offset)
    seed_lo, key_hi, offset_lo = dropout.philox_words
    counter = (i & ~8, j & ~9, b * nheads + h, np.full(i.shape, offset_lo))
    words = philox4x32(counter, (np.full(i.shape, seed_lo), np.full(i.shape, key_hi)))
    word = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    picked = np.take_along_axis(words, word[None].astype(np.int64), axis=0)[0]
    draws = (picked >> (16 * (j & 1)).astype(np.uint32)) & ((1 << DROPOUT_DRAW_BITS) - 1)
    return draws < dropout.threshold
