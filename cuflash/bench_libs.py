"""Attention implementations, timers and measurements behind ``python -m cuflash bench``.

Every library is wrapped in the same small interface so the driver in
``cuflash.benchmark`` can treat them alike:

* ``prepare(q, k, v, causal)`` returns a zero-argument callable that runs one
  forward pass on those inputs (all layout conversion happens here, outside
  the timed region);
* ``context()`` is entered around every batch of calls (torch needs its SDPA
  backend selected);
* ``to_cupy(out)`` turns an output into a CuPy array in (B, N, H, D) layout;
* ``events`` creates/reads CUDA events on the stream the library launches on.

The forward+backward wrappers (``CuflashFwdBwd``, ``TorchSdpaFwdBwd``) take a
fourth input, the output gradient: ``prepare(q, k, v, dout, causal)`` returns
a callable that runs one forward and one backward pass, and ``to_cupy`` turns
its result into the CuPy gradients (dq, dk, dv), each (B, N, H, D).

Raising :class:`Skip` from ``prepare`` means "this library does not run this
shape" and is shown as a dash, never as a failure.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import cupy
import numpy

GiB = 1 << 30
MiB = 1 << 20

# The naive implementation materialises B*H*N*N scores; beyond this it is
# either out of memory or so slow that it only stretches the run.
NAIVE_MAX_SCORES_BYTES = 16 * GiB
NAIVE_MAX_SEQLEN = 8192
# Timing rounds per benchmark row (time_calls).
TIMING_ROUNDS = 5


class Skip(Exception):
    """The library cannot (or should not) run this shape."""


def cupy_dtype(name: str) -> numpy.dtype:
    if name == "float16":
        return numpy.dtype(numpy.float16)
    if name == "bfloat16":
        # CuPy represents bfloat16 through the ml_dtypes NumPy extension.
        import ml_dtypes

        return numpy.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unsupported dtype {name!r}")


def synchronize() -> None:
    # cudaDeviceSynchronize waits for every stream, CuPy's and torch's alike,
    # so it is the one fence needed when switching between libraries.
    cupy.cuda.runtime.deviceSynchronize()


def random_qkv(batch, seqlen, heads, headdim, dtype, seed):
    """Three (B, N, H, D) arrays of standard-normal values (never zeros)."""
    rng = cupy.random.default_rng(seed)
    shape = (batch, seqlen, heads, headdim)
    return tuple(
        rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
        for _ in range(3)
    )


def random_dout(batch, seqlen, heads, headdim, dtype, seed):
    """A (B, N, H, D) output gradient, standard normal, independent of ``random_qkv(..., seed)``."""
    rng = cupy.random.default_rng(1_000_003 + seed)
    return rng.standard_normal((batch, seqlen, heads, headdim), dtype=cupy.float32).astype(dtype)


# --------------------------------------------------------------------------
# Timing


class CupyEvents:
    """CUDA events recorded on CuPy's current stream."""

    @staticmethod
    def record():
        event = cupy.cuda.Event()
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return cupy.cuda.get_elapsed_time(start, end)


class TorchEvents:
    """CUDA events recorded on torch's current stream."""

    def __init__(self, torch):
        self._torch = torch

    def record(self):
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end)


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _warm_up(lib, fns) -> float:
    """Calls that touch every input set and trigger compilation, autotuning and
    workspace allocation; returns the time of the last one, already warm."""
    n = len(fns)
    warm = max(3, n)
    with lib.context():
        for i in range(warm - 1):
            fns[i % n]()
        start = lib.events.record()
        fns[(warm - 1) % n]()
        end = lib.events.record()
        end.synchronize()
    return lib.events.elapsed_ms(start, end)


def time_calls(entries: dict, repeats: int, budget_ms: float = 3000.0, rounds: int = TIMING_ROUNDS) -> dict:
    """Median device time of one call for each library, timed in interleaved rounds.

    entries: name -> (lib, fns), fns one call per input set, rotated over.
    Every library is warmed up, then each of `rounds` rounds times a share of
    every library's calls, starting one library further along each round: a
    variant timed first in every round measured 5-10% low in A/B runs
    (bench/PERFLOG.md), so no library may hold one place. Each call is
    bracketed by its own pair of events, with no synchronisation between a
    library's calls, so the GPU queue stays full and host-side launch latency
    is hidden as it would be in a model. Returns name -> {"ms", "min_ms",
    "repeats"}, or {"error": text} for a library that raised.
    """
    results, plans = {}, {}
    for name, (lib, fns) in entries.items():
        synchronize()
        try:
            estimate = _warm_up(lib, fns)
        except Exception as exc:
            results[name] = {"error": describe(exc)}
            continue
        # Long shapes (the naive baseline above all) get fewer repeats.
        reps = max(min(repeats, 5), min(repeats, int(budget_ms / max(estimate, 1e-3))))
        plans[name] = (lib, fns, reps, [])
    names = list(plans)
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            if name in results:  # raised in an earlier round
                continue
            lib, fns, reps, marks = plans[name]
            first, stop = reps * r // rounds, reps * (r + 1) // rounds
            synchronize()
            try:
                with lib.context():
                    for i in range(first, stop):
                        start = lib.events.record()
                        fns[i % len(fns)]()
                        marks.append((start, lib.events.record()))
                synchronize()
            except Exception as exc:
                results[name] = {"error": describe(exc)}
    for name in names:
        if name not in results:
            lib, _, reps, marks = plans[name]
            times = [lib.events.elapsed_ms(s, e) for s, e in marks]
            results[name] = {"ms": statistics.median(times), "min_ms": min(times), "repeats": reps}
    synchronize()
    return results


# --------------------------------------------------------------------------
# Libraries


class Cuflash:
    """cuflash.attention. mode None: as users call it (tuning cache, else the
    heuristic table); "heuristic": the heuristic table only; "tuned": the
    shape is tuned in `prepare` unless the cache holds it, then the cache."""

    events = CupyEvents()

    def __init__(self, mode=None):
        import cuflash
        from cuflash import dispatch

        self.mode = mode
        self.name = "cuflash-tuned" if mode == "tuned" else "cuflash"
        self._attention = cuflash.attention
        self._heuristic_only = dispatch.heuristic_only

    def prepare(self, q, k, v, causal):
        attention = self._attention
        if self.mode == "tuned":
            attention(q, k, v, causal=causal, tune=True)  # tuning happens here, not in the timed calls
        return lambda: attention(q, k, v, causal=causal)

    def context(self):
        return self._heuristic_only() if self.mode == "heuristic" else contextlib.nullcontext()

    @staticmethod
    def to_cupy(out):
        # Tolerate an API that also returns the log-sum-exp.
        return out[0] if isinstance(out, tuple) else out


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


def naive_attention(q, k, v, causal: bool, dtype=None):
    """softmax(Q K^T / sqrt(D)) V with the N x N scores materialised.

    The unfused baseline: one batched GEMM writes the scores, a row softmax
    runs over them, a second GEMM reads them. Computes in ``dtype`` (default:
    the input dtype) with float32 GEMM accumulation. The causal mask is aligned
    to the bottom-right corner, so query i (of Nq) sees keys j <= i + Nk - Nq,
    the convention FlashAttention uses. The softmax runs in place, so peak
    memory is one N x N buffer plus (B, H, N, D) copies of the inputs.
    """
    dtype = q.dtype if dtype is None else numpy.dtype(dtype)
    batch, nq, heads, d = q.shape
    nk = k.shape[1]

    def heads_major(x):  # (B, N, H, D) -> contiguous (B*H, N, D)
        return cupy.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(dtype, copy=False)).reshape(
            batch * heads, x.shape[1], d)

    s = _bmm(heads_major(q), heads_major(k), transpose_b=True, alpha=1.0 / math.sqrt(d))
    if causal:
        row = cupy.arange(nq)[:, None]
        col = cupy.arange(nk)[None, :]
        # An additive (Nq, Nk) bias broadcasts in place over the batch.
        s += cupy.where(col > row + (nk - nq), -numpy.inf, 0.0).astype(dtype)
    rows = s.reshape(-1, nk)  # 2-D view: cheaper indexing for the row ops
    rows -= rows.max(axis=1, keepdims=True)
    cupy.exp(rows, out=rows)
    rows /= rows.sum(axis=1, keepdims=True)
    out = _bmm(s, heads_major(v))  # (B*H, Nq, D)
    return out.reshape(batch, heads, nq, d).transpose(0, 2, 1, 3)  # (B, Nq, H, D)


def naive_attention_backward(dout, q, k, v, causal: bool):
    """float32 gradients (dq, dk, dv) of softmax(Q K^T / sqrt(D)) V, N x N per head.

    The fallback correctness reference when torch is missing: one (batch,
    head) at a time, so memory stays at a few N x N float32 matrices. Same
    bottom-right causal alignment as :func:`naive_attention`; Nq == Nk
    assumed for the causal mask (every benchmark shape), equal head counts.
    """
    batch, nq, heads, d = q.shape
    nk = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    bias = None
    if causal:
        row = cupy.arange(nq)[:, None]
        col = cupy.arange(nk)[None, :]
        bias = cupy.where(col > row + (nk - nq), -numpy.inf, 0.0).astype(cupy.float32)
    dq, dk, dv = (cupy.empty(x.shape, cupy.float32) for x in (q, k, v))
    for b in range(batch):
        for h in range(heads):
            qh, kh, vh, doh = (cupy.ascontiguousarray(x[b, :, h], dtype=cupy.float32)
                               for x in (q, k, v, dout))
            p = qh @ kh.T
            p *= scale
            if bias is not None:
                p += bias
            p -= p.max(axis=1, keepdims=True)
            cupy.exp(p, out=p)
            p /= p.sum(axis=1, keepdims=True)
            delta = (doh * (p @ vh)).sum(axis=1, keepdims=True)  # rowsum(dO o O)
            dv[b, :, h] = p.T @ doh
            ds = doh @ vh.T  # dP
            ds -= delta
            ds *= p
            del p
            dq[b, :, h] = (ds @ kh) * scale
            dk[b, :, h] = (ds.T @ qh) * scale
            del ds
    return dq, dk, dv


class NaiveCupy:
    name = "naive-cupy"
    events = CupyEvents()

    def __init__(self, max_seqlen=NAIVE_MAX_SEQLEN, max_scores_bytes=NAIVE_MAX_SCORES_BYTES):
        self.max_seqlen = max_seqlen
        self.max_scores_bytes = max_scores_bytes

    def prepare(self, q, k, v, causal):
        batch, n, heads, _ = q.shape
        scores = batch * heads * n * k.shape[1] * q.dtype.itemsize
        if self.max_seqlen is not None and n > self.max_seqlen:
            raise Skip(f"seqlen {n} > {self.max_seqlen}")
        _, total = cupy.cuda.runtime.memGetInfo()
        limit = min(self.max_scores_bytes, total // 3)
        if scores > limit:
            raise Skip(f"scores need {scores / GiB:.1f} GiB")
        return lambda: naive_attention(q, k, v, causal)

    @staticmethod
    def context():
        return contextlib.nullcontext()

    @staticmethod
    def to_cupy(out):
        return out


class CuflashFwdBwd:
    """cuflash.attention (return_lse=True) then cuflash.attention_backward."""

    events = CupyEvents()

    def __init__(self, deterministic=False):
        import cuflash

        self.deterministic = bool(deterministic)
        self.name = "cuflash-det" if deterministic else "cuflash"
        self._attention = cuflash.attention
        self._backward = cuflash.attention_backward

    def prepare(self, q, k, v, dout, causal):
        attention, backward, deterministic = self._attention, self._backward, self.deterministic

        def run():
            out, lse = attention(q, k, v, causal=causal, return_lse=True)
            return backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)

        return run

    @staticmethod
    def context():
        return contextlib.nullcontext()

    @staticmethod
    def to_cupy(grads):
        return tuple(grads)


class TorchSdpa:
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend.

    The tensors are zero-copy DLPack views of the CuPy inputs, transposed to
    torch's (B, H, N, D) convention. Nq == Nk in every shape here, so torch's
    top-left causal alignment equals the bottom-right one used elsewhere.
    """

    def __init__(self, name, backend_name):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self.name = name
        self._torch = torch
        self._backend = getattr(SDPBackend, backend_name)
        self._sdpa_kernel = sdpa_kernel
        self.events = TorchEvents(torch)

    def prepare(self, q, k, v, causal):
        torch = self._torch
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        run = lambda: sdpa(tq, tk, tv, is_causal=causal)  # noqa: E731
        try:
            # An unsupported backend raises at the first call; report it as
            # a skip rather than an error.
            with self.context():
                run()
        except RuntimeError as exc:
            raise Skip(str(exc).splitlines()[0]) from exc
        return run

    def context(self):
        return self._sdpa_kernel(self._backend)

    @staticmethod
    def to_cupy(out):
        return cupy.from_dlpack(out.transpose(1, 2).contiguous())


class TorchSdpaFwdBwd(TorchSdpa):
    """SDPA forward plus ``torch.autograd.grad`` on one pinned backend.

    q, k, v are leaf tensors that require grad: (B, H, N, D) views of the CuPy
    inputs, made once in ``prepare``; the timed call is the forward and
    ``torch.autograd.grad(out, (q, k, v), dout)``.
    """

    def prepare(self, q, k, v, dout, causal):
        torch = self._torch
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        tdout = torch.from_dlpack(dout).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        grad = torch.autograd.grad

        def run():
            out = sdpa(tq, tk, tv, is_causal=causal)
            return grad(out, (tq, tk, tv), tdout)

        try:
            with self.context():
                run()
        except RuntimeError as exc:
            raise Skip(str(exc).splitlines()[0]) from exc
        return run

    @staticmethod
    def to_cupy(grads):
        return tuple(cupy.from_dlpack(g.transpose(1, 2).contiguous()) for g in grads)


def load_torch_libs(log, backward=False) -> list:
    """The torch peers, or an empty list when torch is missing or unusable.

    backward: the forward+backward wrappers instead of the forward ones.
    """
    libs = []
    cls = TorchSdpaFwdBwd if backward else TorchSdpa
    for name, backend in (("torch-flash", "FLASH_ATTENTION"), ("torch-cudnn", "CUDNN_ATTENTION")):
        try:
            libs.append(cls(name, backend))
        except Exception as exc:  # ImportError, no CUDA build, old torch...
            log(f"{name}: unavailable ({type(exc).__name__}: {exc})")
    return libs


# --------------------------------------------------------------------------
# Correctness and memory


def compare(out, ref, atol: float, rtol: float) -> dict:
    """Max-abs error of ``out`` against ``ref``; passes if |d| <= atol + rtol*|ref|.

    NaN or Inf anywhere fails (the comparisons below are False for NaN).
    """
    out32 = out.astype(cupy.float32)
    ref32 = ref.astype(cupy.float32)
    diff = cupy.abs(out32 - ref32)
    max_abs = float(diff.max())
    excess = float((diff - rtol * cupy.abs(ref32)).max())
    ok = bool(excess <= atol) and math.isfinite(max_abs)
    return {"max_abs_err": max_abs, "atol": atol, "rtol": rtol, "ok": ok}


GRAD_NAMES = ("dq", "dk", "dv")


def compare_grads(grads, refs, rel: float, atol: float) -> dict:
    """Max-abs error of each gradient; passes if it is <= rel * max|ref| + atol.

    Gradients are larger than outputs and grow with the sequence length, so
    the tolerance scales with the reference's magnitude. NaN or Inf fails.
    """
    result = {"ok": True, "rel": rel, "atol": atol}
    worst = 0.0
    for name, g, r in zip(GRAD_NAMES, grads, refs):
        g32 = g.astype(cupy.float32)
        r32 = r.astype(cupy.float32)
        max_abs = float(cupy.abs(g32 - r32).max())
        ref_max = float(cupy.abs(r32).max())
        tol = rel * ref_max + atol
        ok = math.isfinite(max_abs) and max_abs <= tol
        result[name] = {"max_abs_err": max_abs, "ref_max_abs": ref_max, "tol": tol, "ok": ok}
        result["ok"] = result["ok"] and ok
        worst = max(worst, max_abs / tol) if math.isfinite(max_abs) else math.inf
    result["max_err_over_tol"] = worst
    return result


def same_bits(a, b) -> bool:
    """Bitwise equality of two arrays of one 2-byte dtype (NaN payloads included)."""
    return a.shape == b.shape and bool(cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)))


def peak_extra_bytes(lib, q, k, v, causal=False, dout=None) -> int:
    """Peak device memory one call allocates beyond its inputs.

    A forward call, or with ``dout`` a forward+backward call (``dout`` is an
    input too; the gradients it returns count as its output).

    One warm-up call first, so one-time costs (compilation, cached workspaces)
    are excluded. For CuPy-based libraries the measured call allocates from a
    fresh memory pool: a pool only grows while blocks are in use and keeps
    freed blocks, so its total afterwards is the call's high-water mark (output
    included). For torch, its allocator's peak statistics give the same.
    """
    inputs = (q, k, v) if dout is None else (q, k, v, dout)
    fn = lib.prepare(*inputs, causal)
    with lib.context():
        lib.to_cupy(fn())
    synchronize()
    if isinstance(lib, TorchSdpa):
        torch = lib._torch
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with lib.context():
            out = fn()
        synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        torch.cuda.empty_cache()
        return peak
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc), lib.context():
        out = fn()
        synchronize()
    peak = pool.total_bytes()
    del out
    pool.free_all_blocks()
    return peak
