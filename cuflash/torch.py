"""cuflash for PyTorch: flash-attn's function names, as torch custom ops that `torch.compile` traces.

    from cuflash.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

`flash_attn_func(q, k, v, ...)` takes flash-attn's layout (batch, seqlen,
nheads, headdim) and keywords, so that a flash-attn user changes one import;
so do the packed forms (`flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`
and their varlen twins). Head dims that are not a multiple of 8 (up to 256) are
padded with zero columns, as flash-attn does.
Each pass is a torch op (`torch.library`, schema from its annotations) with a
fake (meta) implementation and registered autograd, so
`torch.compile(fullgraph=True)` keeps it in the graph without a break. The
kernels run on torch's current stream, on zero-copy views of the tensors;
outputs are allocated by torch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy
import torch

from . import backward as _backward
from . import combine as _combine
from . import forward as _forward
from . import fp8 as _fp8
from . import kv_cache as _kv_cache
from . import reference
from . import validate as _validate
from . import varlen as _varlen
from .arrays import BF16
from .device import OnExternalStream, cupy, memoised_external_array
from .dropout_mask import dropout_keep_mask


def _gpu_index(q: torch.Tensor) -> int:
    """The GPU a call runs on: q's."""
    index = q.get_device()
    if index < 0:
        raise ValueError(f"q must be a CUDA tensor, got one on {q.device}")
    return index


def _require_cuda(q: torch.Tensor, **tensors) -> None:
    """q and a call's other tensors (None: absent) on the GPU, named where not (CuPy's import of a CPU
    tensor names none); arguments that are not tensors are left to the ops' schemas, which name them."""
    _gpu_index(q)
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor on q's device, got one on {x.device}")


def _rows_contiguous(*tensors):
    """The tensors with a contiguous last dim, copied where it is not (flash-attn's maybe_contiguous)."""
    return [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in tensors]


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _on_torch_stream(q: torch.Tensor) -> OnExternalStream:
    """`with _on_torch_stream(q):` CuPy's current device is q's GPU, and its current stream torch's
    current stream there, read through torch's raw getter, which torch's generated code calls (0.1 us a
    call against 3 for torch.cuda.current_stream, H100 host)."""
    index = _gpu_index(q)
    ptr = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream
    return OnExternalStream(cupy().cuda.Device(index), ptr)


# The dtypes the custom ops hand to cuflash, as CuPy's: tensors, lse and offsets.
_DTYPES = {torch.float16: numpy.float16, torch.bfloat16: BF16, torch.float32: numpy.float32,
           torch.int32: numpy.int32, torch.uint8: numpy.uint8}


def _codes(x: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its uint8 codes, as cuflash takes fp8; others as they are."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _cp(x):
    """A CuPy view of a CUDA tensor, valid while the op runs (its arguments hold the memory).

    Built from the tensor's address: the kernels run on torch's current stream, so DLPack's stream
    handshake is not needed, and it cost 29 us a tensor against 8 for a new view (H100 host); views
    are memoised on their layout, so the tensors a training loop passes again cost a lookup."""
    if x is None:
        return None
    dtype = _DTYPES.get(x.dtype)
    if dtype is None or not x.is_cuda:
        return cupy().from_dlpack(x.detach())
    return memoised_external_array(x.data_ptr(), tuple(x.shape), x.stride(), dtype, x.get_device())


_LIBRARY = torch.library.Library("cuflash", "DEF")


def _op(name: str, mutates_args=(), seeded: bool = False):
    """Register the decorated function as torch.ops.cuflash.<name> (schema from its annotations) and
    return the op. Through Library.define/impl, not torch.library.custom_op, whose checks cost ~30 us
    of host time a call against ~8 (measured on the H100 host with a no-op body). seeded: the op
    draws random numbers (dropout's seed), so that torch.compile neither merges two calls nor
    recomputes one."""
    def register(fn):
        tags = (torch.Tag.nondeterministic_seeded,) if seeded else ()
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(torch.ops.cuflash, name).default
    return register


def _options(causal, softmax_scale, window_left, window_right, softcap) -> dict:
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                softcap=softcap)


def _dropout_draw(dropout_p: float) -> torch.Tensor:
    """The (seed, offset) of a call's dropout mask, int64 on the host: drawn from torch's default
    generator (`torch.randint(0, 2**62, (2,))`, so torch.manual_seed makes the mask reproducible),
    zeros without dropout. The backward regenerates the mask from them."""
    if dropout_p > 0:
        return torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return torch.zeros(2, dtype=torch.int64)


def _dropout(dropout_p: float, draw: torch.Tensor) -> dict:
    seed, offset = draw.tolist()
    return dict(dropout_p=dropout_p, seed=seed, offset=offset)


# return_attn_probs with dropout: flash-attn returns, for its tests, the softmax with the dropout
# pattern (S_dmask): each row up to a scale of its own, negated where dropout dropped the element
# (-0.0 reads as kept), 0 where no key is visible, both lengths padded with zeros to multiples of
# PROBS_LENGTH_MULTIPLE. Here each row is scaled so that its largest entry is 1 (flash-attn's scale
# over one key block), computed by cuflash.reference on the host, and the signs are the kernels' keep
# mask (dropout_keep_mask). For tests of small problems: not a fast path.
PROBS_LENGTH_MULTIPLE = 128


def _padded_length(n: int) -> int:
    return -(-n // PROBS_LENGTH_MULTIPLE) * PROBS_LENGTH_MULTIPLE


def _host(x: torch.Tensor | None):
    return None if x is None else x.detach().float().cpu().numpy()


def _signed_probs(q, k, keep, alibi_slopes, options) -> torch.Tensor:
    """float32 (batch, nheads, seqlen_q, seqlen_k) on q's device: each row of the softmax over its
    largest entry, negated where `keep` (a CuPy bool array of that shape) is False."""
    probs = reference.attention_probs(_host(q), _host(k), causal=options.causal,
                                      window_size=(options.window_left, options.window_right),
                                      softcap=options.softcap, alibi_slopes=_host(alibi_slopes),
                                      softmax_scale=options.softmax_scale)
    top = probs.max(axis=-1, keepdims=True)
    scaled = numpy.divide(probs, top, out=numpy.zeros_like(probs), where=top > 0)
    scaled = torch.from_numpy(scaled).to(q.device, torch.float32)
    kept = torch.from_dlpack(keep.view(numpy.uint8)).bool()
    return torch.where(kept, scaled, -scaled)


def _keep_mask_and_canvas(q, draw, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """The kernels' keep mask of a (batch, nheads, seqlen_q, seqlen_k) call (CuPy bool) and the zeros of
    its S_dmask, both lengths padded."""
    seed, offset = draw.tolist()
    with _on_torch_stream(q):
        keep = dropout_keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p)
    return keep, q.new_zeros((batch, nheads, _padded_length(seqlen_q), _padded_length(seqlen_k)))


def _attn_probs(q, k, draw, alibi_slopes, options) -> torch.Tensor:
    """S_dmask of a call of equal lengths (see above): (batch, nheads, seqlen_q, seqlen_k padded)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    keep, probs = _keep_mask_and_canvas(q, draw, batch, nheads, seqlen_q, seqlen_k, options.dropout_p)
    probs[:, :, :seqlen_q, :seqlen_k] = _signed_probs(q, k, keep, alibi_slopes, options)
    return probs


def _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, draw, alibi_slopes,
                       options) -> torch.Tensor:
    """S_dmask of a packed batch: (batch, nheads, max_seqlen_q padded, max_seqlen_k padded), sequence b's
    at [b, :, :its seqlen_q, :its seqlen_k] (the mask of its own positions)."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch, nheads = len(starts_q) - 1, q.shape[1]
    keep, probs = _keep_mask_and_canvas(q, draw, batch, nheads, max_seqlen_q, max_seqlen_k, options.dropout_p)
    per_batch = alibi_slopes is not None and alibi_slopes.dim() == 2
    for b in range(batch):
        rows, cols = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        seqlen_q, seqlen_k = rows.stop - rows.start, cols.stop - cols.start
        if seqlen_q > max_seqlen_q or seqlen_k > max_seqlen_k:
            raise ValueError(f"max_seqlen_q and max_seqlen_k must be at least sequence {b}'s lengths "
                             f"({seqlen_q}, {seqlen_k}), got ({max_seqlen_q}, {max_seqlen_k})")
        slopes = alibi_slopes[b] if per_batch else alibi_slopes
        probs[b, :, :seqlen_q, :seqlen_k] = _signed_probs(q[None, rows], k[None, cols],
                                                          keep[b:b + 1, :, :seqlen_q, :seqlen_k], slopes, options)[0]
    return probs


class _FlashOptions(NamedTuple):
    """flash-attn's keywords as the custom ops take them, in their arguments' order."""
    causal: bool
    softmax_scale: float | None
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool
    dropout_p: float


def _flash_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic) -> _FlashOptions:
    left, right = _validate.window_size(window_size, causal=False)
    scale = None if softmax_scale is None else _validate.given_scale(softmax_scale)
    return _FlashOptions(_validate.flag("causal", causal), scale, left, right, _validate.softcap(softcap),
                         _validate.flag("deterministic", deterministic), _validate.dropout(dropout_p, 0, 0)[0])


# ---------------------------------------------------------------- equal lengths
# Options travel as (causal, softmax_scale, window_left, window_right, softcap, deterministic,
# dropout_p); deterministic matters to the backward only. ALiBi's slopes are a tensor argument,
# which takes no gradient (as in flash-attn). The forward also returns its dropout draw
# (_dropout_draw), which the backward takes.

@_op("fwd", seeded=True)
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None, causal: bool,
         softmax_scale: float | None, window_left: int, window_right: int, softcap: float, deterministic: bool,
         dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    draw = _dropout_draw(dropout_p)
    with _on_torch_stream(q):
        _forward.attention(_cp(q), _cp(k), _cp(v), out=_cp(out), lse=_cp(lse), alibi_slopes=_cp(alibi_slopes),
                           **_dropout(dropout_p, draw),
                           **_options(causal, softmax_scale, window_left, window_right, softcap))
    return out, lse, draw


@torch.library.register_fake("cuflash::fwd")
def _fwd_fake(q, k, v, *options):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64))


@_op("bwd")
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, draw: torch.Tensor, alibi_slopes: torch.Tensor | None, causal: bool,
         softmax_scale: float | None, window_left: int, window_right: int, softcap: float, deterministic: bool,
         dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dout = dout.contiguous()  # held here: the view of it does not keep it alive
    with _on_torch_stream(q):
        _backward.attention_backward(_cp(dout), _cp(q), _cp(k), _cp(v), _cp(out), _cp(lse),
                                     dq=_cp(dq), dk=_cp(dk), dv=_cp(dv), deterministic=deterministic,
                                     alibi_slopes=_cp(alibi_slopes), **_dropout(dropout_p, draw),
                                     **_options(causal, softmax_scale, window_left, window_right, softcap))
    return dq, dk, dv


@torch.library.register_fake("cuflash::bwd")
def _bwd_fake(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, slopes, *options = inputs
    ctx.save_for_backward(q, k, v, slopes, *output)
    ctx.options = options


def _fwd_backward(ctx, dout, dlse, ddraw):
    q, k, v, slopes, out, lse, draw = ctx.saved_tensors
    return (*_bwd(dout, q, k, v, out, lse, draw, slopes, *ctx.options), None, *[None] * len(ctx.options))


torch.library.register_autograd("cuflash::fwd", _fwd_backward, setup_context=_fwd_setup)


# flash-attn takes any head dim up to 256 and pads the others to a multiple of 8 with zero columns,
# which add nothing to q . k; the output's padded columns are dropped, and the softmax scale stays
# 1 / sqrt(the caller's head dim). So do these functions (the kernels take multiples of 8).

def _headdim_padding(q: torch.Tensor) -> int:
    """Zero columns that bring q's head dim to a multiple the kernels take (0 where it is one, and for
    head dims the kernels refuse anyway: larger than MAX_HEADDIM, or fp8)."""
    headdim = q.shape[-1]
    if q.dtype == torch.float8_e4m3fn or headdim > _validate.MAX_HEADDIM:
        return 0
    return -headdim % _validate.HEADDIM_MULTIPLE


def _caller_scale(q: torch.Tensor, softmax_scale) -> float:
    """The softmax scale at the caller's head dim (before padding)."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def _padded(x: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    return None if x is None else torch.nn.functional.pad(x, (0, pad))


def _unpadded(result, headdim: int):
    """A function's result with its output's padded columns dropped (the rest as it is)."""
    if isinstance(result, tuple):
        return (result[0][..., :headdim], *result[1:])
    return result[..., :headdim]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, q_descale=None, k_descale=None,
                    v_descale=None):
    """flash-attn's `flash_attn_func` on cuflash's kernels: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_kv, headdim), float16 or bfloat16 CUDA tensors. Returns out; with
    return_attn_probs, (out, lse, S_dmask): S_dmask None without dropout, with dropout_p flash-attn's
    test output (the softmax with the keep mask's signs: see PROBS_LENGTH_MULTIPLE). dropout_p: the
    mask's seed is drawn from torch's default generator (torch.manual_seed reproduces it) and
    regenerated by the backward; a call captured in a CUDA graph keeps the seed of its capture.
    alibi_slopes: float32 (nheads,) or (batch, nheads), no gradient.
    fp8, as flash-attn 3's: q, k and v torch.float8_e4m3fn with q_descale, k_descale, v_descale
    float32 (batch, nheads_kv) (ones where None); out is bfloat16. Forward only (Hopper), with
    causal, window and softcap."""
    _require_cuda(q, k=k, v=v, alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale)
    q, k, v = _rows_contiguous(q, k, v)
    pad = _headdim_padding(q)
    if pad:
        scale = _caller_scale(q, softmax_scale)
        return _unpadded(flash_attn_func(_padded(q, pad), _padded(k, pad), _padded(v, pad), dropout_p, scale, causal,
                                         window_size, softcap, alibi_slopes, deterministic, return_attn_probs),
                         q.shape[-1])
    options = _flash_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    if q.dtype == torch.float8_e4m3fn:
        out, lse = _fp8_fwd(q, k, v, q_descale, k_descale, v_descale, *_fp8_options(k, v, alibi_slopes, options))
    else:
        _fp8.refuse_descales(q_descale, k_descale, v_descale)
        out, lse, draw = _fwd(q, k, v, alibi_slopes, *options)
        if return_attn_probs and options.dropout_p:
            return out, lse, _attn_probs(q, k, draw, alibi_slopes, options)
    return (out, lse, None) if return_attn_probs else out


# ---------------------------------------------------------------- fp8 (forward only)

def _fp8_options(k, v, alibi_slopes, options) -> tuple:
    """The fp8 op's options (causal, softmax_scale, window_left, window_right, softcap) of
    _flash_options' tuple, for k and v of q's fp8 dtype; what the fp8 kernels lack raises."""
    for name, x in (("k", k), ("v", v)):
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} must be torch.float8_e4m3fn as q is, got {x.dtype}")
    _fp8.refuse_options(alibi_slopes, dropout=bool(options.dropout_p))
    return options.causal, options.softmax_scale, options.window_left, options.window_right, options.softcap


@_op("fp8_fwd")
def _fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
             k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, causal: bool,
             softmax_scale: float | None, window_left: int, window_right: int,
             softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    codes = [_cp(_codes(x)) for x in (q, k, v)]
    with _on_torch_stream(q):
        _forward.attention(*codes, out=_cp(out), lse=_cp(lse), q_descale=_cp(q_descale), k_descale=_cp(k_descale),
                           v_descale=_cp(v_descale), **_options(causal, softmax_scale, window_left, window_right,
                                                                softcap))
    return out, lse


@torch.library.register_fake("cuflash::fp8_fwd")
def _fp8_fwd_fake(q, *rest):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape, dtype=torch.bfloat16),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


# ---------------------------------------------------------------- packed batches

@_op("varlen_fwd", seeded=True)
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                alibi_slopes: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
                causal: bool, softmax_scale: float | None, window_left: int, window_right: int, softcap: float,
                deterministic: bool, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Rows past seqused_q are not written: 0 and -inf there, as cuflash.attention_varlen allocates them.
    out = torch.empty_like(q) if seqused_q is None else torch.zeros_like(q)
    lse_shape = (q.shape[1], q.shape[0])
    lse = q.new_empty(lse_shape, dtype=torch.float32) if seqused_q is None else \
        q.new_full(lse_shape, float("-inf"), dtype=torch.float32)
    draw = _dropout_draw(dropout_p)
    with _on_torch_stream(q):
        _varlen.attention_varlen(_cp(q), _cp(k), _cp(v), _cp(cu_seqlens_q), _cp(cu_seqlens_k), max_seqlen_q,
                                 max_seqlen_k, out=_cp(out), lse=_cp(lse), alibi_slopes=_cp(alibi_slopes),
                                 seqused_q=_cp(seqused_q), seqused_k=_cp(seqused_k), **_dropout(dropout_p, draw),
                                 **_options(causal, softmax_scale, window_left, window_right, softcap))
    return out, lse, draw


@torch.library.register_fake("cuflash::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64))


@_op("varlen_bwd")
def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, draw: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: torch.Tensor | None,
                seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, causal: bool,
                softmax_scale: float | None, window_left: int, window_right: int, softcap: float,
                deterministic: bool, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Rows past seqused_q (dq) and seqused_k (dk, dv) are not written: 0 there.
    dq = torch.empty_like(q) if seqused_q is None else torch.zeros_like(q)
    dk, dv = (torch.empty_like(x) if seqused_k is None else torch.zeros_like(x) for x in (k, v))
    dout = dout.contiguous()  # held here: the view of it does not keep it alive
    with _on_torch_stream(q):
        _varlen.attention_varlen_backward(_cp(dout), _cp(q), _cp(k), _cp(v), _cp(out), _cp(lse),
                                          _cp(cu_seqlens_q), _cp(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                                          dq=_cp(dq), dk=_cp(dk), dv=_cp(dv), deterministic=deterministic,
                                          alibi_slopes=_cp(alibi_slopes), seqused_q=_cp(seqused_q),
                                          seqused_k=_cp(seqused_k), **_dropout(dropout_p, draw),
                                          **_options(causal, softmax_scale, window_left, window_right, softcap))
    return dq, dk, dv


@torch.library.register_fake("cuflash::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, slopes, used_q, used_k, *options = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, slopes, used_q, used_k, *output)
    ctx.lengths, ctx.options = (max_q, max_k), options


def _varlen_backward(ctx, dout, dlse, ddraw):
    q, k, v, cu_q, cu_k, slopes, used_q, used_k, out, lse, draw = ctx.saved_tensors
    grads = _varlen_bwd(dout, q, k, v, out, lse, draw, cu_q, cu_k, *ctx.lengths, slopes, used_q, used_k,
                        *ctx.options)
    return (*grads, *[None] * 7, *[None] * len(ctx.options))


torch.library.register_autograd("cuflash::varlen_fwd", _varlen_backward, setup_context=_varlen_setup)


@_op("varlen_paged_fwd")
def _varlen_paged_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_table: torch.Tensor,
                      alibi_slopes: torch.Tensor | None, causal: bool, softmax_scale: float | None,
                      window_left: int, window_right: int, softcap: float,
                      dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    with _on_torch_stream(q):
        _varlen.attention_varlen(_cp(q), _cp(k_cache), _cp(v_cache), _cp(cu_seqlens_q), _cp(cu_seqlens_k),
                                 max_seqlen_q, max_seqlen_k, out=_cp(out), lse=_cp(lse),
                                 block_table=_cp(block_table), alibi_slopes=_cp(alibi_slopes), dropout_p=dropout_p,
                                 **_options(causal, softmax_scale, window_left, window_right, softcap))
    return out, lse


@torch.library.register_fake("cuflash::varlen_paged_fwd")
def _varlen_paged_fwd_fake(q, *rest):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _paged_backward(ctx, dout, dlse):
    raise NotImplementedError("flash_attn_varlen_func: with block_table (a paged KV cache) there is a forward only")


torch.library.register_autograd("cuflash::varlen_paged_fwd", _paged_backward)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None):
    """flash-attn's `flash_attn_varlen_func`: q (total_q, nheads, headdim), k and v (total_k, nheads_kv,
    headdim), cu_seqlens int32 CUDA tensors (batch + 1,). Returns out; with return_attn_probs,
    (out, lse (nheads, total_q), S_dmask) (S_dmask as flash_attn_func's; None with block_table).
    dropout_p and alibi_slopes as in flash_attn_func.
    block_table: int32 (batch, max_pages); k and v are then a paged KV cache (num_pages, page_size,
    nheads_kv, headdim), sequence b's keys its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions
    (chunked prefill, as `cuflash.attention_varlen`'s; forward only).
    seqused_q, seqused_k: int32 CUDA tensors (batch,), flash-attn 3's (cuflash.attention_varlen's):
    the rows used of each sequence's spans; out and the gradients hold 0 past them."""
    _require_cuda(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
                  block_table=block_table, seqused_q=seqused_q, seqused_k=seqused_k)
    q, k, v = _rows_contiguous(q, k, v)
    pad = _headdim_padding(q)
    if pad:
        scale = _caller_scale(q, softmax_scale)
        return _unpadded(flash_attn_varlen_func(_padded(q, pad), _padded(k, pad), _padded(v, pad), cu_seqlens_q,
                                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal,
                                                window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                                block_table, seqused_q=seqused_q, seqused_k=seqused_k), q.shape[-1])
    options = _flash_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    return_attn_probs = _validate.flag("return_attn_probs", return_attn_probs)
    if block_table is not None:
        if seqused_q is not None or seqused_k is not None:
            raise NotImplementedError("seqused_q, seqused_k: the paged prefill takes the cache lengths from "
                                      "cu_seqlens_k (pass None)")
        out, lse = _varlen_paged_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                     block_table, alibi_slopes, options.causal, options.softmax_scale,
                                     options.window_left, options.window_right, options.softcap, options.dropout_p)
    else:
        if return_attn_probs and options.dropout_p and (seqused_q is not None or seqused_k is not None):
            raise NotImplementedError("return_attn_probs: S_dmask with seqused_q or seqused_k is not supported")
        out, lse, draw = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                     alibi_slopes, seqused_q, seqused_k, *options)
        if return_attn_probs and options.dropout_p:
            return out, lse, _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                int(max_seqlen_k), draw, alibi_slopes, options)
    return (out, lse, None) if return_attn_probs else out


# ---------------------------------------------------------------- packed q, k, v
# flash-attn's packed forms: views of one tensor (the kernels take any strides with a contiguous
# last dim), whose gradient autograd assembles from dq, dk and dv.

def _unpack(name: str, x, dim: int, parts: int, rank: int):
    if x.dim() != rank or x.shape[dim] != parts:
        raise ValueError(f"{name} must have {rank} dims with {parts} at dim {dim}, got shape {tuple(x.shape)}")
    return x.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_qkvpacked_func`: qkv (batch, seqlen, 3, nheads, headdim); the rest as
    flash_attn_func."""
    return flash_attn_func(*_unpack("qkv", qkv, 2, 3, 5), dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_kvpacked_func`: kv (batch, seqlen_k, 2, nheads_kv, headdim); the rest as
    flash_attn_func."""
    return flash_attn_func(q, *_unpack("kv", kv, 2, 2, 5), dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's `flash_attn_varlen_qkvpacked_func`: qkv (total, 3, nheads, headdim), one cu_seqlens
    and max_seqlen for queries and keys; the rest as flash_attn_varlen_func."""
    return flash_attn_varlen_func(*_unpack("qkv", qkv, 1, 3, 4), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_varlen_kvpacked_func`: kv (total_k, 2, nheads_kv, headdim); the rest as
    flash_attn_varlen_func."""
    return flash_attn_varlen_func(q, *_unpack("kv", kv, 1, 2, 4), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


# ---------------------------------------------------------------- KV cache

# cache_seqlens given as one int travels as cache_length, which cuflash checks on the host (against the
# cache's capacity and the rotary tables' rows), as it cannot check a device tensor's values.

@_op("kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def _kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_length: int | None,
                 cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
                 block_table: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                 rotary_interleaved: bool, causal: bool, softmax_scale: float | None, window_left: int,
                 window_right: int, softcap: float, alibi_slopes: torch.Tensor | None, k_descale: torch.Tensor | None,
                 v_descale: torch.Tensor | None, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    k_codes, v_codes = _codes(k_cache), _codes(v_cache)
    with _on_torch_stream(q):
        _kv_cache.attention_with_kvcache(
            _cp(q), _cp(k_codes), _cp(v_codes), _cp(k), _cp(v),
            cache_seqlens=_cp(cache_seqlens) if cache_length is None else cache_length,
            cache_batch_idx=_cp(cache_batch_idx), cache_leftpad=_cp(cache_leftpad), block_table=_cp(block_table),
            rotary_cos=_cp(rotary_cos), rotary_sin=_cp(rotary_sin), rotary_interleaved=rotary_interleaved,
            alibi_slopes=_cp(alibi_slopes), k_descale=_cp(k_descale), v_descale=_cp(v_descale),
            num_splits=num_splits, out=_cp(out), lse=_cp(lse),
            **_options(causal, softmax_scale, window_left, window_right, softcap))
    for cache in (k_cache, v_cache):  # written in place: autograd's version check must see it
        torch.autograd.graph.increment_version(cache)
    return out, lse


@torch.library.register_fake("cuflash::kvcache_fwd")
def _kvcache_fwd_fake(q, *rest):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            k_descale=None, v_descale=None):
    """flash-attn's `flash_attn_with_kvcache` (cuflash.attention_with_kvcache): appends k, v to the caches
    in place and attends. cache_seqlens: an int or an int32 CUDA tensor (batch,). An e4m3 cache is
    torch.float8_e4m3fn (or uint8 codes) with k_descale / v_descale float32 (batch, nheads_kv), as in
    flash-attn 3. Returns out; with return_softmax_lse, (out, lse (batch, nheads, seqlen_q))."""
    _require_cuda(q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  block_table=block_table, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale)
    q, k, v = _rows_contiguous(q, k, v)  # the new keys and values; the caches are written in place
    pad = _headdim_padding(q) if k_cache.dtype in (torch.float16, torch.bfloat16) else 0
    if pad:  # as flash-attn: the caches padded in copies, and the appended rows copied back
        scale = _caller_scale(q, softmax_scale)
        caches = _padded(k_cache, pad), _padded(v_cache, pad)
        result = flash_attn_with_kvcache(
            _padded(q, pad), *caches, _padded(k, pad), _padded(v, pad), rotary_cos, rotary_sin, cache_seqlens,
            cache_batch_idx, cache_leftpad, block_table, scale, causal, window_size, softcap, rotary_interleaved,
            alibi_slopes, num_splits, return_softmax_lse, k_descale, v_descale)
        if k is not None:
            for cache, padded in zip((k_cache, v_cache), caches):
                cache.copy_(padded[..., :q.shape[-1]])
        return _unpadded(result, q.shape[-1])
    cache_length = None
    if _validate.is_int(cache_seqlens):
        cache_seqlens, cache_length = None, int(cache_seqlens)
    left, right = _validate.window_size(window_size, causal=False)
    out, lse = _kvcache_fwd(q, k_cache, v_cache, k, v, cache_seqlens, cache_length, cache_batch_idx, cache_leftpad,
                            block_table, rotary_cos, rotary_sin,
                            _validate.flag("rotary_interleaved", rotary_interleaved), _validate.flag("causal", causal),
                            None if softmax_scale is None else _validate.given_scale(softmax_scale), left, right,
                            _validate.softcap(softcap), alibi_slopes, k_descale, v_descale,
                            _validate.integer("num_splits", num_splits))
    return (out, lse) if _validate.flag("return_softmax_lse", return_softmax_lse) else out


# ---------------------------------------------------------------- partial results

@_op("combine")
def _combine_op(out_partials: torch.Tensor, lse_partials: torch.Tensor,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _, batch, seqlen, nheads, headdim = out_partials.shape
    out = out_partials.new_empty((batch, seqlen, nheads, headdim), dtype=out_dtype)
    lse = out_partials.new_empty((batch, nheads, seqlen), dtype=torch.float32)
    with _on_torch_stream(out_partials):
        _combine.combine_partials(_cp(out_partials), _cp(lse_partials), out=_cp(out), return_lse=True,
                                  lse=_cp(lse))
    return out, lse


@torch.library.register_fake("cuflash::combine")
def _combine_fake(out_partials, lse_partials, out_dtype):
    _, batch, seqlen, nheads, headdim = out_partials.shape
    return (out_partials.new_empty((batch, seqlen, nheads, headdim), dtype=out_dtype),
            out_partials.new_empty((batch, nheads, seqlen), dtype=torch.float32))


def combine_partials(out_partials, lse_partials, out_dtype=None):
    """cuflash.combine_partials on torch tensors (forward only): out_partials float32 (S, batch, seqlen,
    nheads, headdim), each part's normalised output; lse_partials float32 (S, batch, nheads, seqlen),
    each part's logsumexp (any strides). Returns (out (batch, seqlen, nheads, headdim), float32 or
    out_dtype (float16, bfloat16), lse (batch, nheads, seqlen) float32)."""
    for name, x in (("out_partials", out_partials), ("lse_partials", lse_partials)):
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor")
    if out_partials.dim() != 5:
        raise ValueError(f"out_partials must have shape (S, batch, seqlen, nheads, headdim), got "
                         f"{tuple(out_partials.shape)}")
    return _combine_op(out_partials, lse_partials, torch.float32 if out_dtype is None else out_dtype)
