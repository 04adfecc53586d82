"""The implementations the benchmark times, wrapped in one small interface.

* ``prepare(q, k, v, causal)`` returns a zero-argument callable that runs one
  forward pass on those inputs (all layout conversion happens here, outside
  the timed region);
* ``context()`` is entered around every batch of calls (torch needs its SDPA
  backend selected);
* ``to_cupy(out)`` turns an output into a CuPy array in (B, N, H, D) layout;
* ``events`` records and reads CUDA events on the stream the library launches
  on (cuflash.timing's Events).

The forward+backward wrappers (``CuflashFwdBwd``, ``TorchSdpaFwdBwd``) take a
fourth input, the output gradient: ``prepare(q, k, v, dout, causal)`` returns
a callable that runs one forward and one backward pass, and ``to_cupy`` turns
its result into the CuPy gradients (dq, dk, dv), each (B, N, H, D).

Raising :class:`Skip` from ``prepare`` means "this library does not run this
shape" and is shown as a dash, never as a failure.

The cuflash wrappers take a :class:`~cuflash.bench.variants.Variant`, options
passed on every call (``cuflash+opts``); ``JaxCudnn`` and ``JaxCudnnFwdBwd``,
the peers for a sliding window, run only in such runs. The torch wrappers take
a dropout probability (the peers of a run with dropout).
"""

from __future__ import annotations

import contextlib
import functools
import os

import cupy

import cuflash
from cuflash import dispatch
from cuflash.timing import CUPY_EVENTS, HostEvents

from .inputs import GiB
from .naive import naive_attention
from .variants import Variant, effective_window

# The naive implementation materialises B*H*N*N scores; beyond this it is
# either out of memory or so slow that it only stretches the run.
NAIVE_MAX_SCORES_BYTES = 16 * GiB
NAIVE_MAX_SEQLEN = 8192


class Skip(Exception):
    """The library cannot (or should not) run this shape."""


class TorchEvents:
    """CUDA events recorded on torch's current stream (cuflash.timing's Events for torch)."""

    def __init__(self, torch):
        self._torch = torch

    def record(self):
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end)


def _options(variant, q, causal) -> dict:
    """cuflash's keywords for `variant` on q's heads, ALiBi slopes on q's device."""
    options = variant.kwargs(q.shape[2], causal)
    if "alibi_slopes" in options:
        with q.device:
            options["alibi_slopes"] = cupy.asarray(options["alibi_slopes"])
    return options


class Cuflash:
    """cuflash.attention. mode None: as users call it (tuning cache, else the
    heuristic table); "heuristic": the heuristic table only; "tuned": the
    shape is tuned in `prepare` unless the cache holds it, then the cache.
    variant: options passed on every call (the ``cuflash+opts`` column)."""

    events = CUPY_EVENTS

    def __init__(self, mode=None, variant=Variant()):
        self.mode = mode
        self.variant = variant
        self.name = "cuflash-tuned" if mode == "tuned" else "cuflash+opts" if variant.enabled else "cuflash"

    def prepare(self, q, k, v, causal):
        attention = cuflash.attention
        options = _options(self.variant, q, causal)
        if self.mode == "tuned":
            attention(q, k, v, causal=causal, tune=True)  # tuning happens here, not in the timed calls
        return lambda: attention(q, k, v, causal=causal, **options)

    def context(self):
        return dispatch.heuristic_only() if self.mode == "heuristic" else contextlib.nullcontext()

    @staticmethod
    def to_cupy(out):
        return out


class NaiveCupy:
    name = "naive-cupy"
    events = CUPY_EVENTS

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
    """cuflash.attention (return_lse=True) then cuflash.attention_backward, both with `variant`'s options."""

    events = CUPY_EVENTS

    def __init__(self, deterministic=False, variant=Variant()):
        self.deterministic = bool(deterministic)
        self.variant = variant
        self.name = ("cuflash-det" if deterministic else "cuflash") + ("+opts" if variant.enabled else "")

    def prepare(self, q, k, v, dout, causal):
        attention, backward, deterministic = cuflash.attention, cuflash.attention_backward, self.deterministic
        options = _options(self.variant, q, causal)

        def run():
            out, lse = attention(q, k, v, causal=causal, return_lse=True, **options)
            return backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, **options)

        return run

    @staticmethod
    def context():
        return contextlib.nullcontext()

    @staticmethod
    def to_cupy(grads):
        return tuple(grads)


class TorchSdpa:
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend, with `dropout_p`.

    The tensors are zero-copy DLPack views of the CuPy inputs, transposed to
    torch's (B, H, N, D) convention. Nq == Nk in every shape here, so torch's
    top-left causal alignment equals the bottom-right one used elsewhere.
    """

    def __init__(self, name, backend_name, dropout_p=0.0):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self.name = name
        self.dropout_p = dropout_p
        self.torch = torch
        self._backend = getattr(SDPBackend, backend_name)
        self._sdpa_kernel = sdpa_kernel
        self.events = TorchEvents(torch)

    def prepare(self, q, k, v, causal):
        torch = self.torch
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
        sdpa, dropout_p = torch.nn.functional.scaled_dot_product_attention, self.dropout_p
        return self._checked(lambda: sdpa(tq, tk, tv, is_causal=causal, dropout_p=dropout_p))

    def _checked(self, run):
        """run, after one call: an unsupported backend raises there, reported as a skip rather than an error."""
        try:
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
        torch = self.torch
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        tdout = torch.from_dlpack(dout).transpose(1, 2)
        sdpa, dropout_p = torch.nn.functional.scaled_dot_product_attention, self.dropout_p
        grad = torch.autograd.grad

        def run():
            out = sdpa(tq, tk, tv, is_causal=causal, dropout_p=dropout_p)
            return grad(out, (tq, tk, tv), tdout)

        return self._checked(run)

    @staticmethod
    def to_cupy(grads):
        return tuple(cupy.from_dlpack(g.transpose(1, 2).contiguous()) for g in grads)


def import_jax():
    """jax, its device memory left to CuPy and torch until used; raises without a GPU backend."""
    # Before JAX's first import: by default it takes 75% of the device memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.devices("gpu")
    return jax


class JaxCudnn:
    """``jax.nn.dot_product_attention(implementation="cudnn")`` with ``local_window_size``: the peer for
    sliding windows.

    Through JAX, cuDNN takes a left window with the causal mask only (right = 0;
    on these square shapes a non-causal (left, 0) window is that same mask), and
    neither a soft cap nor ALiBi: other options are skipped. XLA launches on
    streams of its own that CUDA events recorded here do not see, so calls are
    timed on the host (HostEvents), which adds the launch latency to each call
    (tens of microseconds: small next to calls of a millisecond or more).
    The inputs are zero-copy DLPack views of the CuPy arrays, in JAX's own
    (B, N, H, D) layout.
    """

    name = "jax-cudnn"
    events = HostEvents()

    def __init__(self, variant):
        self.jax = import_jax()
        self.variant = variant

    def _attention(self, causal):
        variant = self.variant
        if variant.softcap > 0 or variant.alibi:
            raise Skip("jax.nn.dot_product_attention has no soft cap or ALiBi")
        left, right = effective_window(variant.window, causal)
        if left < 0 or right != 0:
            raise Skip(f"cuDNN through JAX takes a left window with right = 0 only, not ({left}, {right})")
        return functools.partial(self.jax.nn.dot_product_attention, implementation="cudnn",
                                 is_causal=True, local_window_size=(left, 0))

    def _views(self, *arrays):
        return [self.jax.dlpack.from_dlpack(x) for x in arrays]

    def prepare(self, q, k, v, causal):
        attention = self.jax.jit(self._attention(causal))
        args = self._views(q, k, v)
        return lambda: attention(*args).block_until_ready()

    @staticmethod
    def context():
        return contextlib.nullcontext()


class JaxCudnnFwdBwd(JaxCudnn):
    """JaxCudnn's forward and the gradients of q, k, v for an output gradient (``jax.vjp``), in one jitted call."""

    def prepare(self, q, k, v, dout, causal):
        jax, attention = self.jax, self._attention(causal)

        def forward_backward(q, k, v, dout):
            _, vjp = jax.vjp(attention, q, k, v)
            return vjp(dout)

        run = jax.jit(forward_backward)
        args = self._views(q, k, v, dout)
        return lambda: jax.block_until_ready(run(*args))


def optional_jax(log):
    """import_jax's jax, or None (logged) when JAX or its GPU backend is missing."""
    try:
        return import_jax()
    except Exception as exc:  # ImportError, a CPU-only jaxlib...
        log(f"jax-cudnn: unavailable ({type(exc).__name__}: {exc})")
        return None


def load_jax_libs(log, variant, backward=False) -> list:
    """The JAX peer for `variant`'s window, or an empty list when JAX or its GPU backend is missing."""
    if optional_jax(log) is None:
        return []
    return [(JaxCudnnFwdBwd if backward else JaxCudnn)(variant)]


def load_torch_libs(log, backward=False, dropout_p=0.0) -> list:
    """The torch peers, or an empty list when torch is missing or unusable.

    backward: the forward+backward wrappers instead of the forward ones; dropout_p: every call's.
    """
    libs = []
    cls = TorchSdpaFwdBwd if backward else TorchSdpa
    for name, backend in (("torch-flash", "FLASH_ATTENTION"), ("torch-cudnn", "CUDNN_ATTENTION")):
        try:
            libs.append(cls(name, backend, dropout_p))
        except Exception as exc:  # ImportError, no CUDA build, old torch...
            log(f"{name}: unavailable ({type(exc).__name__}: {exc})")
    return libs
